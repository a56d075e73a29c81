"""Tests of the built-in models (sizes, stems, shapes, that they learn) and of model loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from common.errors import ModelError
from common.training.models import BUILTIN, build_model


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fits(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 30
) -> tuple[float, float]:
    """Loss before and after a few Adam steps on one fixed batch."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_builtin_names() -> None:
    assert {"hsi-cnn", "scene-cnn", "resnet18", "hsi-3dcnn"} <= set(BUILTIN)


@pytest.mark.parametrize("bands", [3, 13, 198])
def test_resnet18_size(bands: int) -> None:
    n = count(build_model("resnet18", bands, 10, 64))
    assert 11.1e6 < n < 11.7e6, n


def test_resnet18_matches_the_reference_layout() -> None:
    """With 3 bands, 1000 classes and 224 px it is exactly ResNet-18's 11,689,512 parameters."""
    assert count(build_model("resnet18", 3, 1000, 224)) == 11_689_512


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "maxpool"),
    [(5, 3, 1, False), (32, 3, 1, False), (64, 3, 2, False), (100, 3, 2, False), (224, 7, 2, True)],
)
def test_resnet18_stem_follows_input_size(size: int, kernel: int, stride: int, maxpool: bool):
    model = build_model("resnet18", 4, 5, size)
    stem = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert stem.kernel_size == (kernel, kernel) and stem.stride == (stride, stride)
    assert any(isinstance(m, nn.MaxPool2d) for m in model.modules()) == maxpool
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 4, size, size)).shape == (2, 5)


def test_resnet18_small_patches_keep_spatial_maps() -> None:
    """5x5 patches end at 3x3 maps, so BatchNorm trains even on a one-sample batch."""
    model = build_model("resnet18", 198, 4, 5)
    features = nn.Sequential(*list(model.children())[:-3])
    assert features(torch.randn(1, 198, 5, 5)).shape == (1, 512, 3, 3)
    model.train()
    model(torch.randn(1, 198, 5, 5)).sum().backward()


@pytest.mark.slow
def test_resnet18_learns_a_batch() -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 6, 8, 8), torch.arange(8) % 4
    first, last = fits(build_model("resnet18", 6, 4, 8), x, y, steps=10)
    assert last < 0.5 * first


@pytest.mark.parametrize(("bands", "patch"), [(1, 1), (4, 3), (64, 5), (198, 7)])
def test_hsi_3dcnn_shapes(bands: int, patch: int) -> None:
    model = build_model("hsi-3dcnn", bands, 6, patch)
    assert any(isinstance(m, nn.Conv3d) for m in model.modules())
    assert count(model) < 300_000
    model.train()
    out = model(torch.randn(3, bands, patch, patch))
    assert out.shape == (3, 6)
    out.sum().backward()


def test_hsi_3dcnn_learns_a_batch() -> None:
    torch.manual_seed(2)
    x, y = torch.randn(24, 32, 5, 5), torch.arange(24) % 3
    first, last = fits(build_model("hsi-3dcnn", 32, 3, 5), x, y, steps=40)
    assert last < 0.5 * first


def test_existing_models_unchanged() -> None:
    assert (
        count(build_model("hsi-cnn", 198, 4, 5)) == 198 * 64 + 2 * 64 * 64 * 9 + 6 * 64 + 64 * 4 + 4
    )
    assert build_model("scene-cnn", 13, 10, 64)(torch.randn(2, 13, 64, 64)).shape == (2, 10)


def test_user_factory_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models_mod.py").write_text(
        "from torch import nn\n"
        "def linear(in_channels, num_classes, input_size):\n"
        "    width = in_channels * input_size**2\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(width, num_classes))\n"
        "def broken(in_channels, num_classes, input_size):\n"
        "    raise RuntimeError('no such layer')\n"
        "def not_a_module(in_channels, num_classes, input_size):\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("my_models_mod:linear", 3, 2, 5)
    assert model(torch.randn(4, 3, 5, 5)).shape == (4, 2)
    with pytest.raises(ModelError, match="resnet18"):
        build_model("resnet-18", 3, 2, 5)
    with pytest.raises(ModelError, match="cannot load model factory"):
        build_model("my_models_mod:missing", 3, 2, 5)
    with pytest.raises(ModelError, match="cannot load model factory"):
        build_model("no_such_pkg_xyz.models:f", 3, 2, 5)
    with pytest.raises(ModelError, match="no such layer"):
        build_model("my_models_mod:broken", 3, 2, 5)
    with pytest.raises(ModelError, match="returned int"):
        build_model("my_models_mod:not_a_module", 3, 2, 5)
