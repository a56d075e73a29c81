"""Tests of image-folder preparation: PNG, JPEG and multi-band TIFF folders, errors, the CLI."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import tifffile
from click.testing import CliRunner
from PIL import Image

from common.data.convert.folder import prepare_folder, read_image, scan_folder
from common.data.dataset import DatasetReader
from common.errors import DatasetError
from pserver.cli.data_cli import data_group
from tests.support.images import CLASSES, make_tiff_folder


def make_pil_folder(root: Path, suffix: str, mode: str = "RGB", per_class: int = 4) -> dict:
    """PNG or JPEG images (8x8) in each class folder; returns what Pillow decodes back."""
    rng = np.random.default_rng(1)
    images = {}
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            shape = (8, 8, 3) if mode == "RGB" else (8, 8)
            arr = rng.integers(0, 200, size=shape).astype(np.uint8) + 20 * c
            path = root / name / f"img{i}{suffix}"
            Image.fromarray(arr).save(path)
            back = np.asarray(Image.open(path)).astype(np.float32)
            images[path] = back[None] if back.ndim == 2 else np.moveaxis(back, -1, 0)
    return images


def check_dataset(out: Path, images: dict, root: Path, fraction: float) -> None:
    """The file holds every image, normalised with the training images' per-band statistics."""
    names = sorted(CLASSES)
    files = sorted(images, key=lambda p: (names.index(p.parent.name), p.name))
    raw = np.stack([images[p] for p in files])
    labels = np.array([names.index(p.parent.name) for p in files])
    with DatasetReader(out) as r:
        assert r.meta.kind == "scenes" and r.meta.class_names == tuple(names)
        assert r.meta.shape == raw.shape[1:] and r.meta.num_samples == len(files)
        np.testing.assert_array_equal(r.labels, labels)
        per_class = np.bincount(labels)
        expected = np.minimum(per_class - 1, np.maximum(1, np.round(fraction * per_class)))
        assert r.meta.class_counts["train"] == expected.tolist()
        train = r.train_indices
        mean = raw[train].astype(np.float64).mean(axis=(0, 2, 3))
        std = raw[train].astype(np.float64).std(axis=(0, 2, 3))
        np.testing.assert_allclose(r.norm_mean, mean, rtol=1e-5)
        np.testing.assert_allclose(r.norm_std, std, rtol=1e-5)
        x, _ = r.read(np.arange(len(files)))
        want = (raw - mean[:, None, None]) / std[:, None, None]
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-4)
        assert r.verify()
    with h5py.File(out, "r") as f:
        stored = [b.decode() for b in f["files"][...]]
    assert stored == [str(p.relative_to(root)) for p in files]


def test_multiband_tiff_folder(tmp_path: Path) -> None:
    root = tmp_path / "eurosat_ms"
    images = make_tiff_folder(root)
    out = tmp_path / "ms.h5"
    meta = prepare_folder(root, out, train_fraction=0.6, seed=3)
    assert meta.shape == (13, 8, 8)
    check_dataset(out, images, root, 0.6)
    again = prepare_folder(root, tmp_path / "again.h5", train_fraction=0.6, seed=3)
    other = prepare_folder(root, tmp_path / "other.h5", train_fraction=0.6, seed=4)
    assert again.fingerprint == meta.fingerprint != other.fingerprint


@pytest.mark.parametrize("suffix", [".png", ".jpg", ".jpeg", ".PNG"])
def test_rgb_folder(tmp_path: Path, suffix: str) -> None:
    root = tmp_path / "rgb"
    images = make_pil_folder(root, suffix)
    out = tmp_path / "rgb.h5"
    meta = prepare_folder(root, out)
    assert meta.shape == (3, 8, 8) and meta.class_names == tuple(sorted(CLASSES))
    check_dataset(out, images, root, 0.8)


def test_greyscale_png_and_jpeg_have_one_band(tmp_path: Path) -> None:
    for suffix in (".png", ".jpg"):
        root = tmp_path / suffix[1:]
        images = make_pil_folder(root, suffix, mode="L")
        out = tmp_path / f"{suffix[1:]}.h5"
        assert prepare_folder(root, out).shape == (1, 8, 8)
        check_dataset(out, images, root, 0.8)


def test_read_image_layouts_and_resize(tmp_path: Path) -> None:
    img = np.arange(4 * 6 * 10, dtype=np.uint16).reshape(4, 6, 10)
    tifffile.imwrite(tmp_path / "pages.tif", img, photometric="minisblack")  # page per band
    np.testing.assert_array_equal(read_image(tmp_path / "pages.tif"), img)
    tifffile.imwrite(tmp_path / "float.tiff", img[:2].astype(np.float32) / 7)
    np.testing.assert_allclose(read_image(tmp_path / "float.tiff"), img[:2] / 7, rtol=1e-6)
    small = read_image(tmp_path / "pages.tif", size=3)
    assert small.shape == (4, 3, 3) and small.dtype == np.float32
    assert np.all(np.diff(small[0].mean(axis=0)) > 0)  # columns still increase
    Image.fromarray(np.zeros((5, 5), np.uint8)).convert("P").save(tmp_path / "pal.png")
    assert read_image(tmp_path / "pal.png").shape == (3, 5, 5)


def test_size_option_resizes_mixed_sizes(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    make_tiff_folder(root, per_class=3, bands=2, size=8)
    tifffile.imwrite(root / "forest" / "big.tif", np.ones((2, 16, 12), np.uint16))
    out = tmp_path / "resized.h5"
    meta = prepare_folder(root, out, size=6)
    assert meta.shape == (2, 6, 6) and meta.num_samples == 10
    assert meta.attrs["size"] == 6


def test_skips_other_files(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_pil_folder(root, ".png", per_class=3)
    (root / "forest" / "notes.txt").write_text("not an image")
    (root / "forest" / ".DS_Store").write_bytes(b"\0")
    (root / ".hidden_class").mkdir()
    (root / "README.md").write_text("top-level files are ignored")
    scan = scan_folder(root)
    assert scan.class_names == tuple(sorted(CLASSES))
    assert len(scan.files) == 9 and scan.skipped == 1


def assert_fails(root: Path, out: Path, *needles: str, size: int | None = None) -> None:
    with pytest.raises(DatasetError) as err:
        prepare_folder(root, out, size=size)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_mixed_sizes_name_the_file(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_tiff_folder(root, per_class=2, bands=3)
    bad = root / "river" / "river_9.tif"
    tifffile.imwrite(bad, np.zeros((3, 9, 8), np.uint16), photometric="minisblack")
    assert_fails(root, tmp_path / "o.h5", str(bad), "3x9x8", "3x8x8", "--size")


def test_mixed_band_counts_name_the_file(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_tiff_folder(root, per_class=2, bands=4)
    bad = root / "forest" / "forest_5.tif"
    tifffile.imwrite(bad, np.zeros((5, 8, 8), np.uint16), photometric="minisblack")
    assert_fails(root, tmp_path / "o.h5", str(bad), "5x8x8", "4x8x8")
    assert_fails(root, tmp_path / "o.h5", str(bad), "5x6x6", "4x6x6", size=6)


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_pil_folder(root, ".png", per_class=2)
    for name, data in (("broken.png", b"\x89PNG not really"), ("broken.tif", b"II*\0junk")):
        bad = root / "forest" / name
        bad.write_bytes(data)
        assert_fails(root, tmp_path / "o.h5", "cannot read image", str(bad))
        bad.unlink()


def test_non_finite_tiff_is_named(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_tiff_folder(root, per_class=2, bands=2)
    bad = root / "river" / "nan.tif"
    tifffile.imwrite(bad, np.full((2, 8, 8), np.nan, np.float32), planarconfig="separate")
    assert_fails(root, tmp_path / "o.h5", str(bad), "NaN")


def test_empty_class_folder_is_named(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_pil_folder(root, ".png", per_class=2)
    (root / "pasture").mkdir()
    (root / "pasture" / "readme.txt").write_text("no images here")
    assert_fails(root, tmp_path / "o.h5", "class folder", str(root / "pasture"), "no images")


def test_no_class_folders(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    root.mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / "a.png")
    assert_fails(root, tmp_path / "o.h5", str(root), "no class folders")
    assert_fails(tmp_path / "missing", tmp_path / "o.h5", "is not a folder")


def test_bad_arguments(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_pil_folder(root, ".png", per_class=2)
    for fraction in (0.0, 1.0):
        with pytest.raises(DatasetError, match=f"got {fraction}"):
            prepare_folder(root, tmp_path / "o.h5", train_fraction=fraction)
    with pytest.raises(DatasetError, match="size must be a positive integer, got 0"):
        prepare_folder(root, tmp_path / "o.h5", size=0)


def test_prepare_folder_cli(tmp_path: Path) -> None:
    root = tmp_path / "d"
    make_tiff_folder(root, per_class=4, bands=5)
    out = tmp_path / "cli.h5"
    runner = CliRunner()
    args = ["prepare", "folder", str(root), "--out", str(out)]
    res = runner.invoke(data_group, [*args, "--train-fraction", "0.5", "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert "12 samples of 5x8x8, 3 classes, train 6 / test 6" in res.output
    res = runner.invoke(data_group, [*args, "--size", "4"])
    assert res.exit_code == 0 and "5x4x4" in res.output, res.output
    (root / "empty").mkdir()
    res = runner.invoke(data_group, args)
    assert res.exit_code == 1 and str(root / "empty") in res.output
    res = runner.invoke(data_group, ["prepare", "folder", "--help"])
    assert "default: 0.8" in res.output and "--size" in res.output
