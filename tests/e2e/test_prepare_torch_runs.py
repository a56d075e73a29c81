"""``data prepare torch`` end to end: a Dataset class written here converts, trains and predicts
images into a CSV."""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
from click.testing import CliRunner
from PIL import Image

from pserver.cli import main
from tests.support.runs import train
from tests.support.user_dataset import importable_user_module


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module ``user_stripes_<n>`` importable in this process."""
    yield from importable_user_module(tmp_path, monkeypatch)


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
