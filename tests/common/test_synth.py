"""Tests of the synthetic datasets: layout, determinism, difficulty and the synth CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from common.data.convert.synth import synth_hsi, synth_hsi_cube, synth_scenes
from common.data.dataset import DatasetReader, describe
from common.errors import DatasetError
from pserver.cli.data_cli import data_group


def nearest_mean_accuracy(xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray):
    means = np.stack([xtr[ytr == c].mean(0) for c in np.unique(ytr)])
    pred = ((xte[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    return float((pred == yte).mean())


def train_patch_cnn(xtr, ytr, xte, yte, classes: int, epochs: int) -> float:
    """Accuracy of a tiny patch CNN (1x1 spectral conv, one 3x3 conv, pooling) after training."""
    torch.manual_seed(0)
    bands = xtr.shape[1]
    model = nn.Sequential(
        nn.Conv2d(bands, 32, 1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    xt, yt = torch.from_numpy(xtr), torch.from_numpy(ytr)
    for _ in range(epochs):
        for batch in torch.randperm(len(yt)).split(32):
            loss = nn.functional.cross_entropy(model(xt[batch]), yt[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        pred = model(torch.from_numpy(xte)).argmax(1).numpy()
    return float((pred == yte).mean())


def test_hsi_cube_shape_and_regions() -> None:
    cube, labels = synth_hsi_cube(bands=8, size=20, classes=3, seed=5)
    assert cube.shape == (20, 20, 8) and cube.dtype == np.float32
    assert labels.shape == (20, 20) and set(np.unique(labels)) == {-1, 0, 1, 2}
    again, _ = synth_hsi_cube(bands=8, size=20, classes=3, seed=5)
    np.testing.assert_array_equal(cube, again)


def test_synth_hsi_layout_cap_and_determinism(tmp_path: Path) -> None:
    meta = synth_hsi(tmp_path / "a.h5", samples=120, bands=8, size=24, classes=4, seed=3)
    assert meta.kind == "hsi" and meta.shape == (8, 5, 5) and meta.num_samples == 120
    assert meta.num_classes == 4 and all(c >= 1 for c in meta.class_counts["train"])
    assert meta.attrs["patch"] == 5
    same = synth_hsi(tmp_path / "b.h5", samples=120, bands=8, size=24, classes=4, seed=3)
    assert same.fingerprint == meta.fingerprint
    other = synth_hsi(tmp_path / "c.h5", samples=120, bands=8, size=24, classes=4, seed=4)
    assert other.fingerprint != meta.fingerprint


def test_synth_hsi_needs_spatial_context(tmp_path: Path) -> None:
    out = tmp_path / "hsi.h5"
    meta = synth_hsi(out)  # defaults: 64 bands, 64 x 64 pixels, 6 classes, 10 % train
    assert meta.shape == (64, 5, 5) and 3000 < meta.num_samples <= 64 * 64
    with DatasetReader(out) as r:
        xtr, ytr = r.read(r.train_indices)
        xte, yte = r.read(r.test_indices)
    ncm = nearest_mean_accuracy(xtr[:, :, 2, 2], ytr, xte[:, :, 2, 2], yte)
    cnn = train_patch_cnn(xtr, ytr, xte, yte, meta.num_classes, epochs=6)
    assert 0.3 < ncm < 0.8, ncm
    assert cnn > 0.85, cnn


def test_synth_scenes_layout_normalisation_and_split(tmp_path: Path) -> None:
    out = tmp_path / "s.h5"
    meta = synth_scenes(out, samples=80, bands=4, size=16, classes=4, train_fraction=0.75)
    assert meta.kind == "scenes" and meta.shape == (4, 16, 16) and meta.num_samples == 80
    assert meta.class_counts == {"train": [15] * 4, "test": [5] * 4}
    with DatasetReader(out) as r:
        xtr, _ = r.read(r.train_indices)
        xte, _ = r.read(r.test_indices)
        assert np.intersect1d(r.train_indices, r.test_indices).size == 0
        assert r.norm_mean is not None and r.norm_mean.shape == (4,)
    np.testing.assert_allclose(xtr.mean(axis=(0, 2, 3)), 0.0, atol=1e-3)
    np.testing.assert_allclose(xtr.std(axis=(0, 2, 3)), 1.0, atol=1e-3)
    assert not np.allclose(xte.mean(axis=(0, 2, 3)), 0.0, atol=1e-3)  # test stats not used
    again = synth_scenes(
        tmp_path / "t.h5", samples=80, bands=4, size=16, classes=4, train_fraction=0.75
    )
    assert again.fingerprint == meta.fingerprint


def test_synth_scenes_spectra_alone_are_not_enough(tmp_path: Path) -> None:
    out = tmp_path / "s.h5"
    synth_scenes(out, samples=400, bands=13, size=32, classes=10, seed=1)
    with DatasetReader(out) as r:
        xtr, ytr = r.read(r.train_indices)
        xte, yte = r.read(r.test_indices)
    ncm = nearest_mean_accuracy(xtr.mean((2, 3)), ytr, xte.mean((2, 3)), yte)
    assert 0.15 < ncm < 0.65, ncm  # pairs of classes share a signature; texture separates them


def test_synth_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="classes must be >= 2, got 1"):
        synth_hsi(tmp_path / "a.h5", classes=1)
    with pytest.raises(DatasetError, match="samples must be >= 2 \\* classes = 20, got 5"):
        synth_scenes(tmp_path / "a.h5", samples=5)
    with pytest.raises(DatasetError, match="bands must be a positive integer, got 0"):
        synth_scenes(tmp_path / "a.h5", bands=0)
    assert not list(tmp_path.iterdir())


def test_synth_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "h.h5"
    res = runner.invoke(
        data_group,
        ["synth", "--kind", "hsi", "--out", str(out), "--samples", "200", "--size", "20"],
    )
    assert res.exit_code == 0, res.output
    info = describe(out)
    assert info["samples"] == 200 and info["shape"] == [64, 5, 5] and info["classes"] == 6
    out = tmp_path / "s.h5"
    args = ["synth", "--kind", "scenes", "--out", str(out), "--samples", "40", "--size", "8"]
    res = runner.invoke(data_group, [*args, "--bands", "3", "--classes", "4", "--seed", "2"])
    assert res.exit_code == 0, res.output
    info = describe(out)
    assert info["shape"] == [3, 8, 8] and info["counts"]["train"] == 32
    res = runner.invoke(data_group, [*args, "--classes", "30"])
    assert res.exit_code == 1 and "got 40" in res.output
    res = runner.invoke(data_group, ["synth", "--help"])
    assert "hsi 64, scenes 13" in res.output
