"""Scenes in the layouts unmixing benchmarks ship: bands x pixels with nRow/nCol, abundances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.io
from click.testing import CliRunner

from common.data.convert.layout import abundance_labels, load_scene, parse_shape
from common.data.dataset import DatasetReader
from common.errors import DatasetError
from pserver.cli.data_cli import data_group
from tests.support.scenes import abundances_for, to_matrix


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
    assert back.shape[:2] == (6, 5)
    assert "bands x pixels (7 x 30), 6 x 5 from nRow/nCol in the file" in layout
    # pixels x bands with --shape, and (bands, rows, cols) with --bands-first
    scipy.io.savemat(tmp_path / "t.mat", {"X": to_matrix(cube).T})
    back, layout = load_scene(str(tmp_path / "t.mat"), shape=(6, 5))
    np.testing.assert_array_equal(back, cube)
    assert layout is not None and layout.startswith("pixels x bands (30 x 7), 6 x 5 from --shape")
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
