"""Built-in models sized from the dataset, and loading of users' ``package.module:factory``."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from common.errors import ModelError

NORMS = ("batch", "group")
GROUP_SUFFIX = "-gn"  # the GroupNorm build of a built-in model: "hsi-cnn" -> "hsi-cnn-gn"
GROUPS = 8  # channels per GroupNorm group = width / 8 (every built-in width divides by 8)


def norm_layer(norm: str, channels: int, dims: int = 2) -> nn.Module:
    """A normalisation layer over ``channels``: BatchNorm (1-3 ``dims``) or GroupNorm.

    GroupNorm normalises each sample on its own, so its output, and a mean gradient over
    a batch, do not depend on how the batch is split over workers; it keeps no running
    statistics.

    Args:
        norm: ``batch`` or ``group``.
        channels: the channels to normalise.
        dims: spatial dimensions (BatchNorm1d/2d/3d); GroupNorm takes any.

    Returns:
        The layer.
    """
    if norm == "group":
        return nn.GroupNorm(math.gcd(GROUPS, channels), channels)
    return {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims](channels)


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` contains a BatchNorm layer (whose batch statistics depend on the local
    batch)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def with_norm(name: str, norm: str) -> str:
    """The model name for ``norm``: a built-in name with ``GROUP_SUFFIX`` for ``group``.

    Args:
        name: a built-in model name (or a user's ``package.module:factory`` with ``batch``).
        norm: one of ``NORMS``.

    Returns:
        The name to build and record.

    Raises:
        ModelError: ``group`` for a model without a GroupNorm build, or an unknown ``norm``.
    """
    if norm not in NORMS:
        raise ModelError(f"--norm {norm!r} is not one of {', '.join(NORMS)}")
    if norm == "batch" or name.endswith(GROUP_SUFFIX):
        return name
    if name + GROUP_SUFFIX not in BUILTIN:
        raise ModelError(
            f"--norm group: model {name!r} has no GroupNorm build; built-in models have one"
        )
    return name + GROUP_SUFFIX


def hsi_cnn(in_channels: int, num_classes: int, input_size: int, norm: str = "batch") -> nn.Module:
    """Patch CNN for hyperspectral pixels: a 1x1 spectral reduction, then two 3x3 spatial
    convolutions and global pooling; works for any odd patch size."""
    width = 64
    return nn.Sequential(
        nn.Conv2d(in_channels, width, kernel_size=1, bias=False),
        norm_layer(norm, width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, width, kernel_size=3, padding=1, bias=False),
        norm_layer(norm, width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, width, kernel_size=3, padding=1, bias=False),
        norm_layer(norm, width),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


def _conv_block(cin: int, cout: int, norm: str) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        norm_layer(norm, cout),
        nn.ReLU(inplace=True),
    ]


def scene_cnn(
    in_channels: int, num_classes: int, input_size: int, norm: str = "batch"
) -> nn.Module:
    """Small CNN for scene patches (e.g. EuroSAT 64x64): three conv blocks with pooling."""
    return nn.Sequential(
        *_conv_block(in_channels, 32, norm),
        nn.MaxPool2d(2),
        *_conv_block(32, 64, norm),
        nn.MaxPool2d(2),
        *_conv_block(64, 128, norm),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions with a (projected) identity shortcut."""

    def __init__(self, cin: int, cout: int, *, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = norm_layer(norm, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), norm_layer(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _zero_last_bn(model: nn.Module) -> None:
    """Start every residual branch at zero (Goyal et al. 2017): helps large-batch training."""
    for block in model.modules():
        if isinstance(block, BasicBlock) and isinstance(block.bn2.weight, torch.Tensor):
            nn.init.zeros_(block.bn2.weight)  # the residual path's last norm layer


def resnet18(in_channels: int, num_classes: int, input_size: int, norm: str = "batch") -> nn.Module:
    """ResNet-18 (He et al. 2016: four stages of two basic blocks, 64-128-256-512 channels)
    for any number of input bands. The stem depends on the input size (see docs/models.md):
    >= 128 px: the ImageNet stem (7x7 stride-2 conv, 3x3 stride-2 max-pool); 33-127 px (e.g.
    EuroSAT 64x64): a 3x3 stride-2 conv without max-pool; <= 32 px (CIFAR-sized images, HSI
    patches): a 3x3 stride-1 conv without max-pool. A stage halves the resolution only while
    its input is at least 4 px across, so 5x5 patches keep 3x3 maps with BatchNorm statistics.
    About 11.2 M parameters for 10 classes (11.17-11.29 M from 3 to 200 bands).

    Args:
        in_channels: input bands C.
        num_classes: number of classes K.
        input_size: side S of the square input; selects the stem.
        norm: ``batch`` (BatchNorm) or ``group`` (GroupNorm, see ``norm_layer``).

    Returns:
        The model, mapping (N, C, S, S) to logits (N, K).
    """
    if input_size >= 128:
        stem: list[nn.Module] = [
            nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
            norm_layer(norm, 64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]
        side = (input_size + 1) // 2
        side = (side + 1) // 2
    else:
        stride = 2 if input_size > 32 else 1
        stem = [
            nn.Conv2d(in_channels, 64, 3, stride=stride, padding=1, bias=False),
            norm_layer(norm, 64),
            nn.ReLU(inplace=True),
        ]
        side = (input_size - 1) // stride + 1
    layers: list[nn.Module] = []
    cin = 64
    for i, cout in enumerate((64, 128, 256, 512)):
        stride = 2 if i > 0 and side >= 4 else 1
        side = (side - 1) // stride + 1
        layers += [
            BasicBlock(cin, cout, stride=stride, norm=norm),
            BasicBlock(cout, cout, stride=1, norm=norm),
        ]
        cin = cout
    model = nn.Sequential(
        *stem, *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)
    )
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    _zero_last_bn(model)
    return model


class HSI3DCNN(nn.Module):
    """3-D CNN over (spectrum, rows, cols) of (C, P, P) hyperspectral patches."""

    def __init__(
        self, in_channels: int, num_classes: int, *, depth: int = 8, norm: str = "batch"
    ) -> None:
        super().__init__()
        widths = (1, 8, 16, 32)
        kernels = (7, 5, 3)
        spectral: list[nn.Module] = []
        for cin, cout, k in zip(widths[:-1], widths[1:], kernels, strict=True):
            spectral += [
                nn.Conv3d(cin, cout, (k, 3, 3), stride=(2, 1, 1), padding=(k // 2, 1, 1)),
                norm_layer(norm, cout, dims=3),
                nn.ReLU(inplace=True),
            ]
        self.spectral = nn.Sequential(*spectral, nn.AdaptiveAvgPool3d((depth, None, None)))
        self.spatial = nn.Sequential(
            nn.Conv2d(widths[-1] * depth, 64, 3, padding=1, bias=False),
            norm_layer(norm, 64),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, C, P, P) patches to (N, num_classes) logits."""
        f = self.spectral(x.unsqueeze(1))  # (N, 32, depth, P, P)
        return self.spatial(f.flatten(1, 2))


def hsi_3dcnn(
    in_channels: int, num_classes: int, input_size: int, norm: str = "batch"
) -> nn.Module:
    """Small 3-D CNN for hyperspectral patches: three Conv3d layers (kernels 7/5/3 bands x 3x3
    pixels, spectral stride 2), spectral pooling to 8 depths, the depths folded into channels
    for one 3x3 Conv2d, then global pooling (about 170 k parameters); any band count and odd or
    even patch size.

    Args:
        in_channels: spectral bands C.
        num_classes: number of classes K.
        input_size: patch side P (any; the model pools globally).
        norm: ``batch`` (BatchNorm) or ``group`` (GroupNorm, see ``norm_layer``).

    Returns:
        The model, mapping (N, C, P, P) to logits (N, K).
    """
    return HSI3DCNN(in_channels, num_classes, norm=norm)


_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "hsi-cnn": hsi_cnn,
    "scene-cnn": scene_cnn,
    "resnet18": resnet18,
    "hsi-3dcnn": hsi_3dcnn,
}
# Each built-in model in its BatchNorm build and its GroupNorm build (name + GROUP_SUFFIX).
BUILTIN: dict[str, Callable[[int, int, int], nn.Module]] = {
    **_FACTORIES,
    **{
        name + GROUP_SUFFIX: functools.partial(factory, norm="group")
        for name, factory in _FACTORIES.items()
    },
}


def check_allowed(name: str, allowed: Sequence[str], source: str) -> None:
    """Refuse a user model that ``source`` (a server, a file) names unless it is allowed:
    building it imports and runs its module.

    Args:
        name: the model name.
        allowed: the ``package.module:factory`` names given with ``--allow-model``.
        source: who names the model, for the message (e.g. "the server", "model file X").

    Raises:
        ModelError: ``name`` is neither built in nor allowed.
    """
    if name in BUILTIN or name in allowed:
        return
    raise ModelError(
        f"{source} names model {name!r}, which would import code here; "
        f"give --allow-model {name} if you trust it"
    )


def build_model(name: str, in_channels: int, num_classes: int, input_size: int) -> nn.Module:
    """Build a model by built-in name or ``package.module:factory``.

    Args:
        name: a key of ``BUILTIN`` or ``package.module:factory``; the factory is called as
            ``factory(in_channels=C, num_classes=K, input_size=S)``.
        in_channels: input bands C.
        num_classes: number of classes K.
        input_size: spatial size S of the (square) input.

    Returns:
        The model, in float32 on the CPU.

    Raises:
        ModelError: unknown name, unimportable module, or a factory that fails or does not
            return an ``nn.Module``.
    """
    if name in BUILTIN:
        return BUILTIN[name](in_channels, num_classes, input_size).float()
    if ":" not in name:
        raise ModelError(
            f"unknown model {name!r}; built-in models: {sorted(BUILTIN)}, "
            "or give package.module:factory"
        )
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"cannot load model factory {name!r}: {exc}") from exc
    try:
        model = factory(in_channels=in_channels, num_classes=num_classes, input_size=input_size)
    except Exception as exc:
        raise ModelError(f"model factory {name!r} failed: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model factory {name!r} returned {type(model).__name__}, not an nn.Module"
        )
    return model.float()
