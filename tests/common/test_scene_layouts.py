"""Scenes in the layouts unmixing benchmarks ship: bands x pixels with nRow/nCol, abundances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.io
from click.testing import CliRunner

from common.data.convert.hsi import prepare_hsi
from common.data.convert.layout import abundance_labels, load_scene, parse_shape
from common.data.convert.matfile import load_class_names, load_mat_array
from common.data.dataset import DatasetReader
from common.errors import DatasetError
from pserver.data_cli import data_group


def to_matrix(cube: np.ndarray) -> np.ndarray:
    """(rows, cols, bands) -> bands x pixels with pixels in column-major (MATLAB) order."""
    return cube.transpose(2, 1, 0).reshape(cube.shape[2], -1)


def abundances_for(gt: np.ndarray, k: int) -> np.ndarray:
    """End-members x pixels abundances whose argmax (at >= 0.5) gives back the class map.

    A labelled pixel of class c has 0.7 for c and the rest shared; an unlabelled one has a
    largest abundance of 0.4, below the 0.5 at which Jasper Ridge's class map was made.
    """
    rows, cols = gt.shape
    maps = np.full((rows, cols, k), 0.3 / (k - 1))
    for c in range(1, k + 1):
        maps[gt == c, c - 1] = 0.7
    maps[gt == 0] = [0.4] + [0.6 / (k - 1)] * (k - 1)
    return to_matrix(maps)


def test_column_major_pixels_land_where_matlab_puts_them() -> None:
    cube = np.arange(2 * 3 * 4).reshape(2, 3, 4)  # rows 2, cols 3, bands 4
    matrix = to_matrix(cube)
    # MATLAB reshape(V(b, :), nRow, nCol) walks rows first: pixel 1 is (row 1, col 0).
    np.testing.assert_array_equal(matrix[:, 1], cube[1, 0])
    np.testing.assert_array_equal(matrix[:, 2], cube[0, 1])


def test_bands_by_pixels_with_nrow_ncol(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    cube = rng.normal(size=(6, 5, 7))
    path = tmp_path / "scene.mat"
    scipy.io.savemat(
        path,
        {"Y": to_matrix(cube), "nRow": 6.0, "nCol": 5.0, "nBand": 7.0, "maxValue": 1.0},
    )
    back, layout = load_scene(str(path))
    np.testing.assert_array_equal(back, cube)
    assert layout.shape == (6, 5)
    assert "bands x pixels (7 x 30), 6 x 5 from nRow/nCol in the file" in layout.description
    # pixels x bands with --shape, and (bands, rows, cols) with --bands-first
    scipy.io.savemat(tmp_path / "t.mat", {"X": to_matrix(cube).T})
    back, layout = load_scene(str(tmp_path / "t.mat"), shape=(6, 5))
    np.testing.assert_array_equal(back, cube)
    assert layout.description.startswith("pixels x bands (30 x 7), 6 x 5 from --shape")
    scipy.io.savemat(tmp_path / "b.mat", {"X": cube.transpose(2, 0, 1)})
    back, layout = load_scene(str(tmp_path / "b.mat"), bands_first=True)
    np.testing.assert_array_equal(back, cube)
    with pytest.raises(DatasetError, match="give --shape ROWS,COLS"):
        load_scene(str(tmp_path / "t.mat"))
    with pytest.raises(DatasetError, match="= 31 pixels"):
        load_scene(str(tmp_path / "t.mat"), shape=(31, 1))
    assert parse_shape("95, 95") == (95, 95)
    with pytest.raises(DatasetError, match="ROWS,COLS"):
        parse_shape("95x95")


def test_abundance_labels_argmax_and_threshold(tmp_path: Path) -> None:
    gt = np.array([[1, 2, 0], [3, 3, 1]])
    path = tmp_path / "end3.mat"
    names = np.array(["soil", "tree", "water"], dtype=object)
    scipy.io.savemat(path, {"A": abundances_for(gt, 3), "M": np.ones((9, 3)), "cood": names})
    labels, found, description = abundance_labels(str(path), (2, 3))
    np.testing.assert_array_equal(labels, gt)
    assert found == ["soil", "tree", "water"]
    assert "unlabelled below 0.5 (1 of 6 pixels)" in description
    labels, _, _ = abundance_labels(str(path), (2, 3), min_abundance=0.0)
    assert labels[0, 2] == 1  # the mixed pixel's largest end-member
    labels, _, _ = abundance_labels(str(path), (2, 3), min_abundance=0.8)
    assert (labels == 0).all()
    with pytest.raises(DatasetError, match="3 x 6 but the scene has 4 x 4 = 16 pixels"):
        abundance_labels(str(path), (4, 4))


def test_cli_prepares_a_distributed_scene_and_says_so(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows, cols, bands = 12, 9, 5
    gt = rng.integers(1, 4, size=(rows, cols))
    cube = rng.normal(size=(rows, cols, bands)) + gt[..., None]
    scipy.io.savemat(tmp_path / "V.mat", {"V": to_matrix(cube), "nRow": rows, "nCol": cols})
    names = np.array(["soil", "tree", "water"], dtype=object)
    scipy.io.savemat(tmp_path / "end3.mat", {"A": abundances_for(gt, 3), "cood": names})
    runner = CliRunner()
    base = ["prepare", "hsi", "--cube", str(tmp_path / "V.mat"), "--patch", "3"]
    res = runner.invoke(
        data_group, [*base, "--gt", str(tmp_path / "end3.mat"), "--out", str(tmp_path / "o.h5")]
    )
    assert res.exit_code == 1 and "--gt-abundance" in res.output  # 3 x 108 is not a class map
    res = runner.invoke(
        data_group,
        [
            *base,
            "--gt",
            str(tmp_path / "end3.mat"),
            "--gt-abundance",
            "--out",
            str(tmp_path / "o.h5"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "cube layout: bands x pixels (5 x 108), 12 x 9 from nRow/nCol" in res.output
    assert "ground truth: abundances end-members x pixels (3 end-members)" in res.output
    with DatasetReader(tmp_path / "o.h5") as r:
        assert r.meta.class_names == ("soil", "tree", "water")
        assert r.meta.num_samples == rows * cols


def distributed_jasper(jasper_dir: Path, out: Path, crop: int | None = None) -> tuple[Path, Path]:
    """Write Jasper Ridge as the benchmark ships it: ``Y`` (Jasper) or ``V`` (Samson, cropped).

    Returns:
        ``(scene.mat, abundances.mat)``.
    """
    cube = load_mat_array(str(jasper_dir / "JasperRidge.mat"))
    gt = load_mat_array(str(jasper_dir / "JasperRidge_gt.mat:jasper_ridge_gt"))
    names = load_class_names(jasper_dir / "JasperRidge_gt.mat")
    assert names is not None
    if crop is not None:  # Samson's shape: 95 x 95 pixels, 156 bands
        cube, gt = cube[:crop, :crop, :156], gt[:crop, :crop]
    rows, cols, bands = cube.shape
    key = "V" if crop is not None else "Y"
    scene, ends = out / f"{key}_R{bands}.mat", out / f"end{len(names)}.mat"
    scipy.io.savemat(
        scene,
        {
            key: to_matrix(cube).astype(np.float64),
            "nRow": float(rows),
            "nCol": float(cols),
            "nBand": float(bands),
            "maxValue": float(cube.max()),
            "SlectBands": np.arange(1, bands + 1, dtype=np.float64)[:, None],
        },
    )
    scipy.io.savemat(
        ends,
        {
            "A": abundances_for(gt.astype(np.int64), len(names)),
            "M": np.ones((bands, len(names))),
            "cood": np.array(names, dtype=object),
        },
    )
    return scene, ends


@pytest.mark.realdata
@pytest.mark.parametrize("crop", [None, 95], ids=["jasper-Y", "samson-V-95x95x156"])
def test_distributed_jasper_gives_the_preconverted_samples(
    jasper_dir: Path, tmp_path: Path, crop: int | None
) -> None:
    scene, ends = distributed_jasper(jasper_dir, tmp_path, crop)
    cube = load_mat_array(str(jasper_dir / "JasperRidge.mat"))
    gt = load_mat_array(str(jasper_dir / "JasperRidge_gt.mat:jasper_ridge_gt"))
    if crop is not None:
        cube, gt = cube[:crop, :crop, :156], gt[:crop, :crop]
    scipy.io.savemat(tmp_path / "cube.mat", {"cube": cube})
    scipy.io.savemat(
        tmp_path / "gt.mat", {"gt": gt, "class_names": ["tree", "water", "dirt", "road"]}
    )
    ref = prepare_hsi(str(tmp_path / "cube.mat"), str(tmp_path / "gt.mat"), tmp_path / "ref.h5")
    got = prepare_hsi(str(scene), str(ends), tmp_path / "dist.h5", gt_abundance=True)
    assert got.class_names == ref.class_names == ("tree", "water", "dirt", "road")
    assert got.class_counts == ref.class_counts and got.num_samples == ref.num_samples
    with DatasetReader(ref.path) as a, DatasetReader(got.path) as b:
        np.testing.assert_array_equal(a.train_indices, b.train_indices)
        xa, ya = a.read(np.arange(a.meta.num_samples))
        xb, yb = b.read(np.arange(b.meta.num_samples))
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_allclose(xa, xb, atol=1e-5)


@pytest.mark.realdata
def test_distributed_jasper_trains_like_the_preconverted_file(
    jasper_dir: Path, jasper_h5: Path, tmp_path: Path
) -> None:
    from tests.runs import train

    scene, ends = distributed_jasper(jasper_dir, tmp_path)
    dist = prepare_hsi(str(scene), str(ends), tmp_path / "dist.h5", gt_abundance=True)
    ref = train(jasper_h5, tmp_path / "ref", "hsi-cnn", epochs=1, workers=1)
    got = train(Path(dist.path), tmp_path / "dist", "hsi-cnn", epochs=1, workers=1)
    assert ref["final"]["oa"] > 0.7
    assert abs(got["final"]["oa"] - ref["final"]["oa"]) <= 0.02, (got["final"], ref["final"])
