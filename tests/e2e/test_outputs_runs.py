"""Jasper Ridge: train, export, load without the project, predict the map, per-class results."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rasterio
import scipy.io
import torch
from click.testing import CliRunner
from PIL import Image
from rasterio.transform import Affine

from common.data.dataset import DatasetReader
from pserver.cli import main
from pserver.outputs.palette import resolve_palette
from tests.support.cli import one_line_error
from tests.support.runs import train

PATCH = 5


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(main, args)


CRS = "EPSG:32610"

TRANSFORM = Affine(20.0, 0.0, 552000.0, 0.0, -20.0, 4141000.0)


@pytest.fixture(scope="module")
def jasper_model(jasper_h5: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Jasper Ridge run (hsi-cnn, 2 workers, 6 epochs) exported as a program."""
    root = tmp_path_factory.mktemp("jasper_run")
    summary = train(jasper_h5, root / "run", "hsi-cnn", epochs=6)
    model = root / "model.pt"
    res = invoke(["export", str(root / "run"), "--out", str(model)])
    assert res.exit_code == 0, res.output
    return {"root": root, "summary": summary, "model": model, "run": root / "run"}


@pytest.mark.realdata
def test_summary_has_per_class_results(jasper_model: dict[str, Any]) -> None:
    summary = jasper_model["summary"]
    per_class = summary["per_class"]
    assert per_class["names"] == ["tree", "water", "dirt", "road"]
    support = np.array(per_class["support"])
    assert support.sum() == 8675  # the test split: 90 % of 9,639 labelled pixels
    confusion = np.array(per_class["confusion"])
    np.testing.assert_array_equal(confusion.sum(axis=1), support)
    accuracy = np.array(per_class["accuracy"])
    np.testing.assert_allclose(accuracy, np.diag(confusion) / support)
    assert np.dot(accuracy, support) / support.sum() == pytest.approx(summary["final"]["oa"])
    assert accuracy.mean() == pytest.approx(summary["final"]["aa"])


def raw_patches(cube: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """(n, C, P, P) float32 patches of the raw cube, reflect-padded, computed here from numpy."""
    r = PATCH // 2
    padded = np.pad(cube.astype(np.float32), ((r, r), (r, r), (0, 0)), mode="reflect")
    out = [padded[i : i + PATCH, j : j + PATCH].transpose(2, 0, 1) for i, j in pixels]
    return np.ascontiguousarray(np.stack(out))


FRESH = textwrap.dedent(
    """
    import importlib.util, json, sys
    sys.path.append(sys.argv[1])  # torch and numpy only: .pth files (the editable install) unread
    project = [n for n in ("common", "pserver", "worker", "launch") if importlib.util.find_spec(n)]
    assert not project, f"the project is importable: {project}"
    import numpy as np
    import torch
    extra = {"meta.json": ""}
    with open(sys.argv[2], "rb") as handle:
        program = torch.export.load(handle, extra_files=extra)
    meta = json.loads(extra["meta.json"])
    x = torch.from_numpy(np.load(sys.argv[3]))
    with torch.no_grad():
        predicted = program.module()(x).argmax(dim=1).tolist()
    print(json.dumps({"meta": meta, "predicted": predicted}))
    """
)


@pytest.mark.realdata
def test_export_loads_without_the_project_and_predicts_the_full_map(
    jasper_model: dict[str, Any], jasper_dir: Path, jasper_h5: Path, tmp_path: Path
) -> None:
    cube_path, gt_path = jasper_dir / "JasperRidge.mat", jasper_dir / "JasperRidge_gt.mat"
    out = tmp_path / "map.png"
    res = invoke(
        [
            "predict",
            "--model",
            str(jasper_model["model"]),
            "--cube",
            f"{cube_path}:jasper_ridge",
            "--gt",
            str(gt_path),
            "--out",
            str(out),
            "--npy",
            str(tmp_path / "map.npy"),
            "--metrics",
            str(tmp_path / "scores.json"),
            "--batch",
            "700",
        ]
    )
    assert res.exit_code == 0, res.output
    classes = np.load(tmp_path / "map.npy", allow_pickle=False)
    assert classes.shape == (100, 100) and classes.max() <= 3
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["labelled"] == 9639
    test_oa = jasper_model["summary"]["final"]["oa"]
    assert test_oa >= 0.85, jasper_model["summary"]["final"]
    # Agreement on all labelled pixels (training pixels included) within 1 point of test OA.
    assert scores["oa"] >= test_oa - 0.01, (scores["oa"], test_oa)
    gt = scipy.io.loadmat(gt_path)["jasper_ridge_gt"].astype(np.int64)
    labelled = gt > 0
    assert scores["oa"] == pytest.approx(np.mean(classes[labelled] == gt[labelled] - 1))
    assert f"OA {scores['oa']:.4f}" in res.output
    for name, acc in zip(
        scores["per_class"]["names"], scores["per_class"]["accuracy"], strict=True
    ):
        assert name in res.output and f"{acc:.4f}" in res.output

    # The PNG: three panels and a legend strip holding every class colour and "unlabelled".
    image = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert image.shape[0] > 300 and image.shape[1] > 900
    strip = image[int(image.shape[0] * 0.85) :].reshape(-1, 3)
    for colour in [*resolve_palette("auto", ["tree", "water", "dirt", "road"])[0], (0, 0, 0)]:
        near = np.abs(strip - np.array(colour)).max(axis=1) <= 2
        assert near.sum() > 50, f"legend colour {colour} missing"

    # A fresh interpreter that cannot import this project loads the file and classifies
    # raw patches cut here with numpy: the same classes as the map.
    rng = np.random.default_rng(0)
    pixels = np.concatenate(
        [[[0, 0], [0, 99], [99, 0], [99, 99], [1, 50]], rng.integers(0, 100, size=(195, 2))]
    )
    cube = scipy.io.loadmat(cube_path)["jasper_ridge"]
    np.save(tmp_path / "patches.npy", raw_patches(cube, pixels))
    site = str(Path(torch.__file__).resolve().parents[1])
    isolated = tmp_path / "isolated"
    isolated.mkdir()
    isolated_python = [sys.executable, "-I", "-S", "-W", "error", "-c"]
    proc = subprocess.run(
        [*isolated_python, FRESH, site, str(jasper_model["model"]), str(tmp_path / "patches.npy")],
        cwd=isolated,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no warnings (they are errors there anyway) and no log noise
    found = json.loads(proc.stdout)
    assert found["predicted"] == classes[pixels[:, 0], pixels[:, 1]].tolist()
    meta = found["meta"]
    assert meta["class_names"] == ["tree", "water", "dirt", "road"]
    assert (meta["bands"], meta["patch"], meta["model"]) == (198, 5, "hsi-cnn")
    assert meta["dataset"]["fingerprint"] == DatasetReader(jasper_h5).meta.fingerprint
    assert meta["summary"]["final"] == jasper_model["summary"]["final"]


@pytest.mark.realdata
def test_geotiff_and_envi_scenes_give_the_same_map_and_keep_georeferencing(
    jasper_model: dict[str, Any], jasper_dir: Path, tmp_path: Path
) -> None:
    import spectral.io.envi as envi

    cube = scipy.io.loadmat(jasper_dir / "JasperRidge.mat")["jasper_ridge"]
    profile = {"driver": "GTiff", "height": 100, "width": 100, "count": 198, "dtype": "uint16"}
    with rasterio.open(tmp_path / "scene.tif", "w", crs=CRS, transform=TRANSFORM, **profile) as f:
        f.write(np.moveaxis(cube, -1, 0))
    envi.save_image(str(tmp_path / "scene.hdr"), cube, dtype=np.uint16, interleave="bsq")
    maps = {}
    for name in ("scene.tif", "scene.hdr", "JasperRidge.mat"):
        source = tmp_path / name if name.startswith("scene") else jasper_dir / name
        stem = name.replace(".", "_")
        args = ["predict", "--model", str(jasper_model["model"]), "--cube", str(source)]
        args += ["--out", str(tmp_path / f"{stem}.png"), "--no-progress", "--batch", "4096"]
        args += ["--npy", str(tmp_path / f"{stem}.npy")]
        if name == "scene.tif":
            args += ["--geotiff", str(tmp_path / "map.tif")]
        res = invoke(args)
        assert res.exit_code == 0, res.output
        maps[name] = np.load(tmp_path / f"{stem}.npy")
    np.testing.assert_array_equal(maps["scene.tif"], maps["JasperRidge.mat"])
    np.testing.assert_array_equal(maps["scene.hdr"], maps["JasperRidge.mat"])
    with rasterio.open(tmp_path / "map.tif") as out:
        assert out.crs == rasterio.crs.CRS.from_string(CRS)
        assert out.transform == TRANSFORM
        assert out.count == 1 and out.nodata == 0
        np.testing.assert_array_equal(out.read(1), maps["scene.tif"] + 1)
        assert json.loads(out.tags(1)["CLASS_NAMES"]) == ["tree", "water", "dirt", "road"]
        assert (
            out.colormap(1)[1][:3]
            == resolve_palette("auto", ["tree", "water", "dirt", "road"])[0][0]
        )


@pytest.mark.realdata
def test_state_dict_export(jasper_model: dict[str, Any], jasper_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    res = invoke(["export", str(jasper_model["run"]), "--out", str(out), "--format", "state-dict"])
    assert res.exit_code == 0, res.output
    saved = torch.load(out, weights_only=True)
    assert saved["meta"]["model"] == "hsi-cnn" and saved["meta"]["export"] == "state-dict"
    assert all(isinstance(v, torch.Tensor) for v in saved["state_dict"].values())
    from common.training.models import build_model

    network = build_model("hsi-cnn", 198, 4, 5)
    network.load_state_dict(saved["state_dict"])  # rebuilds with the project's own class
    maps = []
    for model in (out, jasper_model["model"]):
        npy = tmp_path / f"{model.stem}.npy"
        args = ["predict", "--model", str(model), "--cube", str(jasper_dir / "JasperRidge.mat")]
        res = invoke([*args, "--out", str(tmp_path / "m.png"), "--npy", str(npy), "--no-progress"])
        assert res.exit_code == 0, res.output
        maps.append(np.load(npy))
    np.testing.assert_array_equal(maps[0], maps[1])


@pytest.mark.realdata
def test_bad_input_gets_one_line_errors(
    jasper_model: dict[str, Any], jasper_dir: Path, tmp_path: Path
) -> None:
    cube = str(jasper_dir / "JasperRidge.mat")
    out = str(tmp_path / "m.png")
    text = tmp_path / "notes.pt"
    text.write_text("not a model")
    archive = tmp_path / "archive.pt"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data.txt", "hello")
    ckpt = next((jasper_model["run"] / "checkpoints").iterdir())
    for bad in (text, archive):
        res = invoke(["predict", "--model", str(bad), "--cube", cube, "--out", out])
        one_line_error(res, str(bad), "not a model file written by 'pserver export'")
    res = invoke(["predict", "--model", str(ckpt), "--cube", cube, "--out", out])
    one_line_error(res, str(ckpt), "is a training checkpoint", "'pserver export RUN_DIR")
    ten_bands = tmp_path / "ten.tif"
    profile = {"driver": "GTiff", "height": 8, "width": 8, "count": 10, "dtype": "uint16"}
    with rasterio.open(ten_bands, "w", crs=CRS, transform=TRANSFORM, **profile) as f:
        f.write(np.ones((10, 8, 8), dtype=np.uint16))
    model = str(jasper_model["model"])
    res = invoke(["predict", "--model", model, "--cube", str(ten_bands), "--out", out])
    one_line_error(res, "has 10 bands", "trained on 198")
    res = invoke(["predict", "--model", model, "--cube", f"{cube}:nope", "--out", out])
    one_line_error(res, "key 'nope' not found", "jasper_ridge")
    res = invoke(["predict", "--model", model, "--cube", cube, "--out", out, "--device", "cuda:0"])
    if not torch.cuda.is_available():
        one_line_error(res, "--device cuda:0", "no CUDA device")
    res = invoke(["export", str(tmp_path), "--out", str(tmp_path / "x.pt")])
    one_line_error(res, "no checkpoint")
    assert not (tmp_path / "m.png").exists()
