"""``data prepare torch``: a Dataset class written here converts and trains; images to a CSV."""

from __future__ import annotations

import csv
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import tifffile
from click.testing import CliRunner
from PIL import Image

from common.data.convert.torch_dataset import parse_kwargs, prepare_torch
from common.errors import DatasetError
from pserver.cli import main
from tests.runs import train

MODULE = textwrap.dedent(
    """
    import numpy as np
    import torch


    class Stripes(torch.utils.data.Dataset):
        \"\"\"Images of horizontal stripes, vertical stripes or plain noise (0..255 values).\"\"\"

        classes = ["horizontal", "vertical", "plain"]

        def __init__(self, n=240, size=16, bands=3, seed=0):
            self.n, self.size, self.bands, self.seed = n, size, bands, seed
            self.labels = np.random.default_rng(seed).integers(0, 3, n)

        def __len__(self):
            return self.n

        def image(self, i):
            rng = np.random.default_rng([self.seed, i])
            x = rng.integers(60, 120, size=(self.bands, self.size, self.size)).astype(np.float32)
            stripes = (np.arange(self.size) // 2 % 2 == 0) * 100.0
            label = int(self.labels[i])
            if label == 0:
                x += stripes[None, :, None]
            elif label == 1:
                x += stripes[None, None, :]
            return x, label

        def __getitem__(self, i):
            x, label = self.image(i)
            return {"image": torch.from_numpy(x), "label": torch.tensor(label)}


    class Tuples(Stripes):
        classes = None

        def __getitem__(self, i):
            return self.image(i)


    class Jittery(Stripes):
        def __getitem__(self, i):
            x, label = self.image(i)
            return {"image": torch.from_numpy(x + np.random.rand()), "label": label}


    class Masks(Stripes):
        def __getitem__(self, i):
            return {"image": torch.zeros(3, 4, 4), "mask": torch.zeros(4, 4)}
    """
)


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module ``user_stripes_<n>`` importable in this process."""
    name = f"user_stripes_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_parse_kwargs() -> None:
    assert parse_kwargs("n=12,name=abc,flag=True,scale=0.5,none=None,s='x y'") == {
        "n": 12,
        "name": "abc",
        "flag": True,
        "scale": 0.5,
        "none": None,
        "s": "x y",
    }
    assert parse_kwargs(None) == {} and parse_kwargs("") == {}
    with pytest.raises(DatasetError, match="NAME=VALUE"):
        parse_kwargs("justaword")


def test_converts_dicts_and_tuples_alike(user_module: str, tmp_path: Path) -> None:
    a = prepare_torch(f"{user_module}:Stripes", tmp_path / "a.h5", {"n": 60}, progress=False)
    assert a.class_names == ("horizontal", "vertical", "plain")
    assert a.shape == (3, 16, 16) and a.num_samples == 60 and a.kind == "scenes"
    b = prepare_torch(
        f"{user_module}:Tuples", tmp_path / "b.h5", {"n": 60}, ["h", "v", "p"], progress=False
    )
    assert b.fingerprint == a.fingerprint and b.class_names == ("h", "v", "p")
    c = prepare_torch(f"{user_module}:Tuples", tmp_path / "c.h5", {"n": 60}, progress=False)
    assert c.class_names == ("class_0", "class_1", "class_2")
    # Stratified split, normalisation from the training samples only.
    with h5py.File(tmp_path / "a.h5", "r") as f:
        x, y, train_idx = f["x"][...], f["y"][...], f["train_idx"][...]
        mean, std = f["norm_mean"][...], f["norm_std"][...]
    per_class = np.bincount(y, minlength=3)
    assert np.all(np.abs(np.bincount(y[train_idx], minlength=3) - 0.8 * per_class) <= 1)
    train = x[train_idx].transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(train.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=1), 1.0, atol=1e-5)
    assert np.all(mean > 60) and np.all(std > 10)  # raw statistics stored


def test_conversion_errors(user_module: str, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="differs between two reads"):
        prepare_torch(f"{user_module}:Jittery", tmp_path / "j.h5", {"n": 20}, progress=False)
    with pytest.raises(DatasetError, match="segmentation mask is not a class label"):
        prepare_torch(f"{user_module}:Masks", tmp_path / "m.h5", {"n": 20}, progress=False)
    with pytest.raises(DatasetError, match="cannot import"):
        prepare_torch(f"{user_module}:Nope", tmp_path / "n.h5", progress=False)
    with pytest.raises(DatasetError, match="failed: TypeError"):
        prepare_torch(f"{user_module}:Stripes", tmp_path / "n.h5", {"bogus": 1}, progress=False)
    with pytest.raises(DatasetError, match="labels run from 0 to 2 but there are 2 class names"):
        prepare_torch(
            f"{user_module}:Tuples", tmp_path / "n.h5", {"n": 30}, ["a", "b"], progress=False
        )
    assert not list(tmp_path.glob("*.h5"))


def write_images(root: Path, dataset: Any, indices: range) -> None:
    """Class folders of images: TIFF (C, H, W) for two classes, RGB PNG for the third."""
    for i in indices:
        x, label = dataset.image(i)
        folder = root / dataset.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        if label == 2:
            rgb = np.moveaxis(x, 0, -1).astype(np.uint8)
            Image.fromarray(rgb, mode="RGB").save(folder / f"{i:04d}.png")
        else:
            tifffile.imwrite(folder / f"{i:04d}.tif", x, photometric="minisblack")


@pytest.mark.e2e
def test_prepare_torch_trains_and_predicts_images(user_module: str, tmp_path: Path) -> None:
    out = tmp_path / "stripes.h5"
    res = CliRunner().invoke(
        main,
        [
            *("data", "prepare", "torch", "--dataset", f"{user_module}:Stripes"),
            *("--kwargs", "n=240,size=16", "--train-fraction", "0.75", "--out", str(out)),
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "240 samples of 3x16x16, 3 classes, train 180 / test 60" in res.output
    summary = train(out, tmp_path / "run", "scene-cnn", epochs=6, workers=1)
    assert summary["final"]["oa"] >= 0.9, summary["final"]
    assert summary["per_class"]["names"] == ["horizontal", "vertical", "plain"]

    model = tmp_path / "scenes.pt"
    res = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--out", str(model)])
    assert res.exit_code == 0, res.output
    module = sys.modules[user_module]
    dataset = module.Stripes(n=300, size=16)
    write_images(tmp_path / "images", dataset, range(240, 300))  # samples never seen
    csv_path = tmp_path / "predictions.csv"
    res = CliRunner().invoke(
        main,
        [
            *("predict", "--model", str(model), "--images", str(tmp_path / "images")),
            *("--out", str(csv_path), "--no-progress"),
        ],
    )
    assert res.exit_code == 0, res.output
    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 60 and set(rows[0]) == {"file", "class", "index", "confidence", "true"}
    assert {Path(r["file"]).suffix for r in rows} == {".tif", ".png"}
    correct = sum(r["class"] == r["true"] for r in rows)
    assert correct / 60 >= 0.85
    assert f"accuracy {correct / 60:.4f}" in res.output
    assert all(0.0 < float(r["confidence"]) <= 1.0 for r in rows)

    # A scene model is not a pixel classifier.
    tifffile.imwrite(
        tmp_path / "cube.tif", np.zeros((3, 8, 8), np.float32), photometric="minisblack"
    )
    res = CliRunner().invoke(
        main,
        [
            *("predict", "--model", str(model), "--cube", str(tmp_path / "cube.tif")),
            *("--out", str(tmp_path / "m.png")),
        ],
    )
    assert res.exit_code == 1 and "use --images DIR" in res.output
