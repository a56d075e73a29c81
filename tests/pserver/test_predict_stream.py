"""Scene prediction streams: windowed reads, every pixel classified as from the whole scene."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import rasterio
import torch
from rasterio.transform import Affine

import common.data.convert.patches as patches
from common.data.convert.cube import open_cube
from common.data.convert.geotiff import GdalCube
from common.errors import DatasetError
from pserver.outputs.export import RawInput
from pserver.outputs.model_file import LoadedModel
from pserver.outputs.predict import count_nodata, nodata_index, predict_scene, score_map

BANDS, PATCH = 6, 3


def tiny_model() -> LoadedModel:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(BANDS, 5, 3, padding=1),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
    )
    mean, std = np.linspace(100, 200, BANDS), np.linspace(10, 30, BANDS)
    meta = {"kind": "hsi", "bands": BANDS, "patch": PATCH, "class_names": list("abcde")}
    return LoadedModel(Path("tiny"), meta, RawInput(net, mean, std=std).eval(), torch.device("cpu"))


def test_predict_reads_windows_and_matches_the_whole_scene(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    cube = rng.normal(150, 40, size=(41, 29, BANDS)).astype(np.float32)
    profile = {"driver": "GTiff", "height": 41, "width": 29, "count": BANDS, "dtype": "float32"}
    geo = {"crs": "EPSG:4326", "transform": Affine(0.1, 0.0, 10.0, 0.0, -0.1, 50.0)}
    with rasterio.open(tmp_path / "c.tif", "w", **profile, **geo) as f:
        f.write(np.moveaxis(cube, -1, 0))
    monkeypatch.setattr(patches, "BAND_BYTES", 7 * (29 + PATCH - 1) * BANDS * 4)
    spans: list[int] = []
    original = GdalCube.read_rows

    def recording(self: GdalCube, start: int, stop: int) -> np.ndarray:
        spans.append(stop - start)
        return original(self, start, stop)

    monkeypatch.setattr(GdalCube, "read_rows", recording)
    model = tiny_model()
    with open_cube(str(tmp_path / "c.tif")) as source:
        classes = predict_scene(model, source, batch=37, progress=False)
    assert len(spans) >= 6 and max(spans) <= 7 + PATCH - 1  # bands of 5 rows + 2 reflected

    padded = np.pad(cube, ((1, 1), (1, 1), (0, 0)), mode="reflect")
    everything = np.stack(
        [
            padded[i : i + PATCH, j : j + PATCH].transpose(2, 0, 1)
            for i in range(41)
            for j in range(29)
        ]
    )
    with torch.no_grad():
        expected = model.module(torch.from_numpy(everything)).argmax(1).numpy().reshape(41, 29)
    np.testing.assert_array_equal(classes, expected)
    assert classes.dtype == np.uint8 and len(np.unique(classes)) > 1


def test_band_mismatch_and_scores(tmp_path: Path) -> None:
    profile = {"driver": "GTiff", "height": 4, "width": 4, "count": 2, "dtype": "uint8"}
    geo = {"crs": "EPSG:4326", "transform": Affine(0.1, 0.0, 10.0, 0.0, -0.1, 50.0)}
    with rasterio.open(tmp_path / "two.tif", "w", **profile, **geo) as f:
        f.write(np.zeros((2, 4, 4), dtype=np.uint8))
    with (
        open_cube(str(tmp_path / "two.tif")) as source,
        pytest.raises(DatasetError, match="has 2 bands but model 'tiny' was trained on 6"),
    ):
        predict_scene(tiny_model(), source, progress=False)
    classes = np.array([[0, 1], [2, 2]])
    gt = np.array([[1, 0], [3, 1]])  # one unlabelled pixel, two right, one wrong
    scores = score_map(classes, gt, 3)
    assert scores.support == (2, 0, 1) and scores.oa == pytest.approx(2 / 3)
    assert scores.accuracy == (0.5, None, 1.0)
    with pytest.raises(DatasetError, match="label 4 but the model knows 3"):
        score_map(classes, gt + 1, 3)


def test_pixels_with_nan_in_their_patch_are_no_data_not_a_class(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    cube = rng.normal(150, 40, size=(12, 10, BANDS)).astype(np.float32)
    cube[5, 4, 2] = np.nan  # its 3 x 3 neighbourhood cannot be classified
    cube[0, 9, :] = np.inf
    profile = {"driver": "GTiff", "height": 12, "width": 10, "count": BANDS, "dtype": "float32"}
    geo = {"crs": "EPSG:4326", "transform": Affine(0.1, 0.0, 10.0, 0.0, -0.1, 50.0)}
    with rasterio.open(tmp_path / "c.tif", "w", **profile, **geo) as f:
        f.write(np.moveaxis(cube, -1, 0))
    model = tiny_model()
    proba = np.empty((12, 10, len(model.class_names)), dtype=np.float32)
    with open_cube(str(tmp_path / "c.tif")) as source:
        classes = predict_scene(model, source, batch=16, progress=False)
        np.testing.assert_array_equal(predict_scene(model, source, 7, False, proba), classes)
        for wrong in (np.empty((10, 12, len(model.class_names)), np.float32), proba[:, ::-1]):
            with pytest.raises(DatasetError, match="C-contiguous"):  # filled, then lost
                predict_scene(model, source, 7, False, wrong)
    expected = np.zeros((12, 10), dtype=bool)
    expected[4:7, 3:6] = True
    expected[0:2, 8:10] = True
    assert np.array_equal(classes == nodata_index(model.class_names), expected)
    assert count_nodata(classes, model.class_names) == 9 + 4
    assert classes[~expected].max() < len(model.class_names)
    assert np.isnan(proba[expected]).all() and np.isfinite(proba[~expected]).all()
    np.testing.assert_allclose(proba[~expected].sum(axis=1), 1.0, atol=1e-5)
    gt = np.ones((12, 10), dtype=np.int64)  # every pixel labelled class 0
    scores = score_map(classes, gt, len(model.class_names))
    assert sum(scores.support) == 120 - 13  # no-data pixels are left out of the scores
