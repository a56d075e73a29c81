"""Built-in models sized from the dataset, and loading of users' ``package.module:factory``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from common.errors import ModelError


def hsi_cnn(in_channels: int, num_classes: int, input_size: int) -> nn.Module:
    """Patch CNN for hyperspectral pixels: a 1x1 spectral reduction, then two 3x3 spatial
    convolutions and global pooling; works for any odd patch size."""
    width = 64
    return nn.Sequential(
        nn.Conv2d(in_channels, width, kernel_size=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, width, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, width, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


def _conv_block(cin: int, cout: int) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


def scene_cnn(in_channels: int, num_classes: int, input_size: int) -> nn.Module:
    """Small CNN for scene patches (e.g. EuroSAT 64x64): three conv blocks with pooling."""
    return nn.Sequential(
        *_conv_block(in_channels, 32),
        nn.MaxPool2d(2),
        *_conv_block(32, 64),
        nn.MaxPool2d(2),
        *_conv_block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


BUILTIN: dict[str, Callable[[int, int, int], nn.Module]] = {
    "hsi-cnn": hsi_cnn,
    "scene-cnn": scene_cnn,
}


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
