"""Tests of hyperspectral preparation: .mat reading (v5 and v7.3), patches, splits, the CLI."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.io
from click.testing import CliRunner

from common.data.convert.hsi import prepare_hsi
from common.data.convert.matfile import load_class_names, load_mat_array, split_spec
from common.data.dataset import DatasetReader
from common.errors import DatasetError
from pserver.cli.data_cli import data_group

ROWS, COLS, BANDS = 14, 12, 4
NAMES = ["grass", "water", "roof"]


def scene(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small cube (rows, cols, bands) uint16 and a gt map with labels 0..3 (0 unlabelled)."""
    rng = np.random.default_rng(seed)
    cube = rng.integers(0, 5000, size=(ROWS, COLS, BANDS)).astype(np.uint16)
    gt = np.zeros((ROWS, COLS), dtype=np.uint8)
    gt[:, :4] = 1
    gt[:, 4:8] = 2
    gt[:, 8:] = 3
    gt[rng.random((ROWS, COLS)) < 0.1] = 0
    return cube, gt


def save_v5(folder: Path, cube: np.ndarray, gt: np.ndarray, names: list[str] | None = NAMES):
    cube_path, gt_path = folder / "cube.mat", folder / "cube_gt.mat"
    scipy.io.savemat(cube_path, {"cube": cube})
    gt_vars: dict[str, object] = {"gt": gt}
    if names is not None:
        gt_vars["class_names"] = np.array(names, dtype=object)
    scipy.io.savemat(gt_path, gt_vars)
    return cube_path, gt_path


def save_v73(path: Path, arrays: dict[str, np.ndarray], names: list[str] | None = None) -> None:
    """Write a MATLAB v7.3-style file: HDF5 with a 512-byte userblock and MATLAB's headers."""
    with h5py.File(path, "w", userblock_size=512) as f:
        for key, arr in arrays.items():
            ds = f.create_dataset(key, data=np.asarray(arr).T)  # MATLAB is column-major
            ds.attrs["MATLAB_class"] = np.bytes_({"uint8": "uint8"}.get(arr.dtype.name, "double"))
        if names is not None:
            refs = f.create_group("#refs#")
            cell = f.create_dataset("class_names", shape=(len(names), 1), dtype=h5py.ref_dtype)
            cell.attrs["MATLAB_class"] = np.bytes_("cell")
            for i, name in enumerate(names):
                chars = refs.create_dataset(
                    f"n{i}", data=np.array([[ord(c)] for c in name], dtype=np.uint16)
                )
                chars.attrs["MATLAB_class"] = np.bytes_("char")
                cell[i, 0] = chars.ref
    header = b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created by: test HDF5 schema 1.00 ."
    with path.open("r+b") as fh:
        fh.write(header.ljust(116, b" ") + b"\x00" * 8 + b"\x00\x02IM")


def test_split_spec() -> None:
    assert split_spec("a/b.mat") == (Path("a/b.mat"), None)
    assert split_spec("a/b.mat:cube") == (Path("a/b.mat"), "cube")
    assert split_spec("C:/data/b.mat") == (Path("C:/data/b.mat"), None)


def test_load_v5_with_and_without_key(tmp_path: Path) -> None:
    cube, gt = scene()
    cube_path, gt_path = save_v5(tmp_path, cube, gt)
    np.testing.assert_array_equal(load_mat_array(str(cube_path)), cube)
    np.testing.assert_array_equal(load_mat_array(f"{cube_path}:cube"), cube)
    np.testing.assert_array_equal(load_mat_array(str(gt_path)), gt)  # class_names is not numeric
    assert load_class_names(gt_path) == NAMES
    assert load_class_names(cube_path) is None


def test_missing_key_lists_keys_found(tmp_path: Path) -> None:
    cube, gt = scene()
    _, gt_path = save_v5(tmp_path, cube, gt)
    with pytest.raises(DatasetError) as err:
        load_mat_array(f"{gt_path}:labels")
    msg = str(err.value)
    assert "'labels'" in msg and "cube_gt.mat" in msg and "gt 14x12 uint8" in msg
    assert "class_names" in msg
    two = tmp_path / "two.mat"
    scipy.io.savemat(two, {"a": np.ones((2, 2)), "b": np.zeros(3)})
    with pytest.raises(DatasetError, match=r"2 numeric arrays.*keys found: a 2x2 double, b"):
        load_mat_array(str(two))
    with pytest.raises(DatasetError, match="not a numeric array"):
        load_mat_array(f"{gt_path}:class_names")
    with pytest.raises(DatasetError, match="does not exist"):
        load_mat_array(str(tmp_path / "nope.mat"))
    junk = tmp_path / "junk.mat"
    junk.write_bytes(b"\x01" * 300)
    with pytest.raises(DatasetError, match=r"junk\.mat"):
        load_mat_array(str(junk))


def test_load_v73_transposes_back(tmp_path: Path) -> None:
    cube, gt = scene()
    path = tmp_path / "v73.mat"
    save_v73(path, {"gt": gt}, names=NAMES)
    with pytest.raises(NotImplementedError):
        scipy.io.loadmat(path)  # scipy refuses v7.3, so the h5py path is exercised
    got = load_mat_array(str(path))
    assert got.shape == (ROWS, COLS)
    np.testing.assert_array_equal(got, gt)
    assert load_class_names(path) == NAMES
    cube_path = tmp_path / "cube73.mat"
    save_v73(cube_path, {"cube": cube.astype(np.float64), "other": np.ones(3)})
    np.testing.assert_array_equal(load_mat_array(f"{cube_path}:cube"), cube)
    with pytest.raises(DatasetError, match=r"keys found: cube 14x12x4 double, other"):
        load_mat_array(f"{cube_path}:missing")


def test_prepare_patches_split_and_normalisation(tmp_path: Path) -> None:
    cube, gt = scene()
    cube_path, gt_path = save_v5(tmp_path, cube, gt)
    out = tmp_path / "d.h5"
    meta = prepare_hsi(str(cube_path), str(gt_path), out, patch=5, train_fraction=0.2, seed=1)
    labelled = int((gt > 0).sum())
    assert meta.num_samples == labelled and meta.shape == (BANDS, 5, 5)
    assert meta.class_names == tuple(NAMES) and meta.kind == "hsi"
    with DatasetReader(out) as r:
        train, test = r.train_indices, r.test_indices
        assert np.intersect1d(train, test).size == 0
        assert train.size + test.size == labelled
        per_class = np.bincount(gt[gt > 0] - 1)
        expected = np.maximum(1, np.round(0.2 * per_class)).astype(int)
        assert meta.class_counts["train"] == expected.tolist()
        x, y = r.read(np.arange(meta.num_samples))
        with h5py.File(out, "r") as f:
            coords = f["coords"][...]
            mean, std = f["norm_mean"][...], f["norm_std"][...]
        np.testing.assert_array_equal(y, gt[coords[:, 0], coords[:, 1]] - 1)
        # Normalisation uses the training pixels only.
        train_pixels = cube[coords[train, 0], coords[train, 1]].astype(np.float64)
        np.testing.assert_allclose(mean, train_pixels.mean(0), rtol=1e-5)
        np.testing.assert_allclose(std, train_pixels.std(0), rtol=1e-5)
        all_pixels = cube[gt > 0].astype(np.float64)
        assert not np.allclose(mean, all_pixels.mean(0), rtol=1e-5)
        np.testing.assert_allclose(x[train, :, 2, 2].mean(0), 0.0, atol=1e-4)
        norm = ((cube - mean) / std).astype(np.float32)
        np.testing.assert_allclose(x[:, :, 2, 2], norm[coords[:, 0], coords[:, 1]], rtol=1e-5)
        # A corner pixel's patch is reflect-padded.
        padded = np.pad(norm, ((2, 2), (2, 2), (0, 0)), mode="reflect")
        i = int(np.argmax((coords[:, 0] == coords[:, 0].min()) & (coords[:, 1] == 0)))
        r0, c0 = coords[i]
        want = padded[r0 : r0 + 5, c0 : c0 + 5].transpose(2, 0, 1)
        np.testing.assert_allclose(x[i], want, rtol=1e-5)
    again = prepare_hsi(
        str(cube_path), str(gt_path), tmp_path / "e.h5", patch=5, train_fraction=0.2, seed=1
    )
    assert again.fingerprint == meta.fingerprint
    other = prepare_hsi(
        str(cube_path), str(gt_path), tmp_path / "f.h5", patch=5, train_fraction=0.2, seed=2
    )
    assert other.fingerprint != meta.fingerprint


def test_prepare_v73_matches_v5(tmp_path: Path) -> None:
    cube, gt = scene()
    cube_path, gt_path = save_v5(tmp_path, cube, gt)
    cube73, gt73 = tmp_path / "c73.mat", tmp_path / "g73.mat"
    save_v73(cube73, {"cube": cube.astype(np.float64)})
    save_v73(gt73, {"gt": gt}, names=NAMES)
    a = prepare_hsi(str(cube_path), str(gt_path), tmp_path / "a.h5", patch=3)
    b = prepare_hsi(str(cube73), str(gt73), tmp_path / "b.h5", patch=3)
    assert a.fingerprint == b.fingerprint and b.class_names == tuple(NAMES)


def test_prepare_errors(tmp_path: Path) -> None:
    cube, gt = scene()
    cube_path, gt_path = save_v5(tmp_path, cube, gt)
    bad_gt = tmp_path / "bad_gt.mat"
    scipy.io.savemat(bad_gt, {"gt": gt[:10]})
    with pytest.raises(DatasetError) as err:
        prepare_hsi(str(cube_path), str(bad_gt), tmp_path / "o.h5")
    assert "10x12" in str(err.value) and "14x12" in str(err.value)
    with pytest.raises(DatasetError, match="odd integer >= 1, got 4"):
        prepare_hsi(str(cube_path), str(gt_path), tmp_path / "o.h5", patch=4)
    for fraction in (0.0, 1.0):
        with pytest.raises(DatasetError, match=f"got {fraction}"):
            prepare_hsi(str(cube_path), str(gt_path), tmp_path / "o.h5", train_fraction=fraction)
    with pytest.raises(DatasetError, match="'stripes'"):
        prepare_hsi(str(cube_path), str(gt_path), tmp_path / "o.h5", split="stripes")
    few = tmp_path / "few_gt.mat"
    scipy.io.savemat(few, {"gt": gt, "class_names": np.array(["a", "b"], dtype=object)})
    with pytest.raises(DatasetError, match="labels up to 3 but class_names lists only 2"):
        prepare_hsi(str(cube_path), str(few), tmp_path / "o.h5")
    assert not (tmp_path / "o.h5").exists()


def test_default_class_names(tmp_path: Path) -> None:
    cube, gt = scene()
    cube_path, gt_path = save_v5(tmp_path, cube, gt, names=None)
    meta = prepare_hsi(str(cube_path), str(gt_path), tmp_path / "d.h5", patch=1)
    assert meta.class_names == ("class_1", "class_2", "class_3")
    assert meta.shape == (BANDS, 1, 1)


def test_disjoint_split_has_no_overlapping_patches(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rows = cols = 40
    cube = rng.normal(size=(rows, cols, 3))
    gt = (np.arange(cols)[None, :] // 14 + 1).repeat(rows, axis=0).astype(np.uint8)
    cube_path, gt_path = tmp_path / "c.mat", tmp_path / "g.mat"
    scipy.io.savemat(cube_path, {"cube": cube})
    scipy.io.savemat(gt_path, {"gt": gt})
    patch = 3
    meta = prepare_hsi(
        str(cube_path),
        str(gt_path),
        tmp_path / "d.h5",
        patch=patch,
        train_fraction=0.2,
        split="disjoint",
        seed=4,
    )
    assert all(c > 0 for c in meta.class_counts["train"])
    assert all(c > 0 for c in meta.class_counts["test"])
    with h5py.File(tmp_path / "d.h5", "r") as f:
        coords = f["coords"][...]
        train, test = f["train_idx"][...], f["test_idx"][...]
        assert f.attrs["split"] == "disjoint"
    assert np.intersect1d(train, test).size == 0
    gap = np.abs(coords[test][:, None, :] - coords[train][None, :, :]).max(axis=-1)
    assert gap.min() >= patch  # Chebyshev distance >= P: the P x P patches share no pixel


def test_prepare_hsi_cli(tmp_path: Path) -> None:
    cube, gt = scene()
    cube_path, gt_path = save_v5(tmp_path, cube, gt)
    out = tmp_path / "cli.h5"
    runner = CliRunner()
    args = ["prepare", "hsi", "--cube", f"{cube_path}:cube", "--gt", str(gt_path)]
    res = runner.invoke(data_group, [*args, "--out", str(out), "--patch", "3", "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert "samples" in res.output and out.is_file()
    res = runner.invoke(
        data_group,
        ["prepare", "hsi", "--cube", f"{cube_path}:nope", "--gt", str(gt_path), "--out", str(out)],
    )
    assert res.exit_code == 1 and "keys found: cube" in res.output
    res = runner.invoke(data_group, [*args, "--out", str(out), "--train-fraction", "1.5"])
    assert res.exit_code == 2
    res = runner.invoke(data_group, ["prepare", "folder", str(tmp_path), "--out", str(out)])
    assert res.exit_code == 1 and "no class folders" in res.output  # tmp_path holds .mat files
    res = runner.invoke(data_group, ["prepare", "hsi", "--help"])
    assert "default: 5" in res.output and "default: random" in res.output
