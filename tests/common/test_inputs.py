"""ENVI and GeoTIFF scenes and class maps: the same dataset as the .mat route, read in windows."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import rasterio
import scipy.io
import spectral.io.envi as envi
from click.testing import CliRunner
from rasterio.transform import Affine

import common.data.convert.patches as patches
from common.data.convert.cube import load_labels, open_cube
from common.data.convert.geotiff import GdalCube
from common.data.convert.hsi import prepare_hsi
from common.data.convert.patches import padded_rows, reflect_indices
from common.errors import DatasetError
from pserver.cli.data_cli import data_group

NAMES = ["tree", "water", "dirt", "road"]
CRS = "EPSG:32610"
TRANSFORM = Affine(20.0, 0.0, 552000.0, 0.0, -20.0, 4141000.0)  # 20 m pixels, north up


def write_geotiff(path: Path, array: np.ndarray) -> None:
    """Write (rows, cols, bands) or (rows, cols) as a georeferenced GeoTIFF with rasterio."""
    bands = array[..., None] if array.ndim == 2 else array
    profile = {
        "driver": "GTiff",
        "height": bands.shape[0],
        "width": bands.shape[1],
        "count": bands.shape[2],
        "dtype": bands.dtype.name,
        "crs": CRS,
        "transform": TRANSFORM,
    }
    with rasterio.open(path, "w", **profile) as out:
        out.write(np.moveaxis(bands, -1, 0))


def jasper_arrays(jasper_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    cube = scipy.io.loadmat(jasper_dir / "JasperRidge.mat")["jasper_ridge"]
    gt = scipy.io.loadmat(jasper_dir / "JasperRidge_gt.mat")["jasper_ridge_gt"]
    return cube, gt


def contents(path: Path) -> dict[str, object]:
    with h5py.File(path, "r") as f:
        out = {k: f[k][...] for k in ("x", "y", "train_idx", "test_idx", "norm_mean", "norm_std")}
        out["coords"] = f["coords"][...]
        out["fingerprint"] = f.attrs["fingerprint"]
        out["class_names"] = f.attrs["class_names"]
    return out


def assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["fingerprint"] == b["fingerprint"]
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.realdata
@pytest.mark.slow
def test_envi_and_geotiff_give_the_mat_dataset(
    jasper_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cube, gt = jasper_arrays(jasper_dir)
    assert cube.dtype == np.uint16 and cube.shape == (100, 100, 198)
    mat_cube, mat_gt = jasper_dir / "JasperRidge.mat", jasper_dir / "JasperRidge_gt.mat"
    reference = tmp_path / "mat.h5"
    prepare_hsi(str(mat_cube), str(mat_gt), reference, patch=5, train_fraction=0.1, seed=3)
    expected = contents(reference)

    envi.save_image(str(tmp_path / "cube.hdr"), cube, dtype=np.uint16, interleave="bil")
    envi.save_classification(
        str(tmp_path / "gt.hdr"), gt.astype(np.uint8), class_names=["Unclassified", *NAMES]
    )
    write_geotiff(tmp_path / "cube.tif", cube)
    write_geotiff(tmp_path / "gt.tif", gt.astype(np.uint8))

    # Windowed reads: with a small band budget no read asks for more than a few rows.
    monkeypatch.setattr(patches, "BAND_BYTES", 16 * 104 * 198 * 4)
    spans: list[int] = []
    original = GdalCube.read_rows

    def recording(self: GdalCube, start: int, stop: int) -> np.ndarray:
        if self.shape[2] > 1:  # the cube's reads (a class map is read whole)
            spans.append(stop - start)
        return original(self, start, stop)

    monkeypatch.setattr(GdalCube, "read_rows", recording)
    runs = {
        "envi cube, mat gt": (str(tmp_path / "cube.hdr"), str(mat_gt), None),
        "envi data file, envi gt": (str(tmp_path / "cube.img"), str(tmp_path / "gt.hdr"), None),
        "geotiff cube and gt": (str(tmp_path / "cube.tif"), str(tmp_path / "gt.tif"), NAMES),
    }
    for name, (cube_spec, gt_spec, names) in runs.items():
        out = tmp_path / f"{name.replace(' ', '_').replace(',', '')}.h5"
        prepare_hsi(cube_spec, gt_spec, out, patch=5, train_fraction=0.1, seed=3, class_names=names)
        assert_same(expected, contents(out))
    assert spans and max(spans) <= 20 < 100  # 16 rows + 2 * 2 reflected rows at most

    # The CLI route with --classes, and a GeoTIFF class map without names.
    res = CliRunner().invoke(
        data_group,
        [
            "prepare",
            "hsi",
            "--cube",
            str(tmp_path / "cube.tif"),
            "--gt",
            str(tmp_path / "gt.tif"),
            "--out",
            str(tmp_path / "cli.h5"),
            "--seed",
            "3",
            "--classes",
            ",".join(NAMES),
        ],
    )
    assert res.exit_code == 0, res.output
    assert_same(expected, contents(tmp_path / "cli.h5"))
    unnamed = prepare_hsi(str(tmp_path / "cube.tif"), str(tmp_path / "gt.tif"), tmp_path / "u.h5")
    assert unnamed.class_names == ("class_1", "class_2", "class_3", "class_4")


def test_georeferencing_is_read(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    write_geotiff(tmp_path / "c.tif", rng.integers(0, 900, size=(6, 7, 3), dtype=np.int16))
    with open_cube(str(tmp_path / "c.tif")) as cube:
        assert cube.shape == (6, 7, 3) and cube.windowed
        assert cube.georef is not None
        assert rasterio.crs.CRS.from_wkt(cube.georef.crs) == rasterio.crs.CRS.from_string(CRS)
        assert cube.georef.transform == tuple(TRANSFORM)[:6]
    gt = rng.integers(0, 4, size=(6, 7), dtype=np.uint8)
    write_geotiff(tmp_path / "g.tif", gt)
    labels, names, georef = load_labels(str(tmp_path / "g.tif"))
    np.testing.assert_array_equal(labels, gt)
    assert names is None and georef is not None and georef.transform == tuple(TRANSFORM)[:6]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_reflect_indices_match_numpy_pad(size: int) -> None:
    for pad in (0, 1, 2, 5, 9):
        base = np.arange(size)
        expected = np.pad(base, pad, mode="reflect")
        got = base[reflect_indices(np.arange(-pad, size + pad), size)]
        np.testing.assert_array_equal(got, expected, err_msg=f"size {size} pad {pad}")


def test_padded_rows_equal_a_reflect_padded_cube(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    cube = rng.normal(size=(9, 5, 2)).astype(np.float32)
    write_geotiff(tmp_path / "c.tif", cube)
    full = np.pad(cube, ((3, 3), (3, 3), (0, 0)), mode="reflect")
    with open_cube(str(tmp_path / "c.tif")) as source:
        for start, stop in ((0, 2), (2, 7), (7, 9), (0, 9)):
            np.testing.assert_array_equal(
                padded_rows(source, start, stop, 3), full[start : stop + 6]
            )


def test_input_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    write_geotiff(tmp_path / "c.tif", rng.integers(0, 9, size=(4, 4, 2), dtype=np.uint8))
    (tmp_path / "notes.txt").write_text("not a raster")
    with pytest.raises(DatasetError, match="cannot tell the format"):
        open_cube(str(tmp_path / "notes.txt"))
    with pytest.raises(DatasetError, match=r"only applies to \.mat"):
        open_cube(f"{tmp_path / 'c.tif'}:cube")
    with pytest.raises(DatasetError, match="does not exist"):
        open_cube(str(tmp_path / "missing.tif"))
    with pytest.raises(DatasetError, match="has 2 bands; a class map has one"):
        load_labels(str(tmp_path / "c.tif"))
    write_geotiff(tmp_path / "g.tif", np.ones((3, 4), dtype=np.uint8))
    with pytest.raises(DatasetError, match="3x4 but cube"):
        prepare_hsi(str(tmp_path / "c.tif"), str(tmp_path / "g.tif"), tmp_path / "o.h5", patch=1)
    (tmp_path / "bad.tif").write_bytes(b"II*\x00garbage")
    with pytest.raises(DatasetError, match="cannot read GeoTIFF"):
        open_cube(str(tmp_path / "bad.tif"))
    assert not (tmp_path / "o.h5").exists()


def _envi_header(path: Path, rows: int, cols: int, bands: int) -> None:
    path.write_text(
        f"ENVI\nsamples = {cols}\nlines = {rows}\nbands = {bands}\nheader offset = 0\n"
        "file type = ENVI Standard\ndata type = 4\ninterleave = bsq\nbyte order = 0\n"
    )


@pytest.mark.parametrize("lines", ["+4000000", "4000000\t;x"])
def test_header_numbers_only_gdal_reads_are_checked_too(tmp_path: Path, lines: str) -> None:
    """The size check runs again on the header as GDAL read it."""
    (tmp_path / "scene.img").write_bytes(bytes(240))
    _envi_header(tmp_path / "scene.hdr", 4, 5, 3)
    text = (tmp_path / "scene.hdr").read_text().replace("lines = 4\n", f"lines = {lines}\n")
    (tmp_path / "scene.hdr").write_text(text)
    with pytest.raises(DatasetError, match=r"4000000 x 5 x 3 .* but its data .* holds 240"):
        open_cube(str(tmp_path / "scene.hdr"))


@pytest.mark.parametrize(("rows", "cols", "bands"), [(10**6, 10**6, 16), (10, 10, 10**11)])
def test_an_envi_header_larger_than_its_data_is_refused(
    tmp_path: Path, rows: int, cols: int, bands: int
) -> None:
    """A damaged or hostile header would size a map or a window of terabytes."""
    (tmp_path / "scene.img").write_bytes(bytes(4000))
    _envi_header(tmp_path / "scene.hdr", rows, cols, bands)
    needed = rows * cols * bands * 4
    with pytest.raises(DatasetError, match=rf"\({needed} bytes\), but its data .* holds 4000"):
        open_cube(str(tmp_path / "scene.hdr"))
    with pytest.raises(DatasetError, match=rf"\({needed} bytes\), but its data .* holds 4000"):
        load_labels(str(tmp_path / "scene.img"))
    _envi_header(tmp_path / "scene.hdr", 10, 10, 10)  # exactly the data's size
    with open_cube(str(tmp_path / "scene.hdr")) as cube:
        assert cube.shape == (10, 10, 10)
