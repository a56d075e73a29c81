"""Hyperspectral scenes read by rows: .mat (whole), ENVI and GeoTIFF (windowed), class maps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data.convert.envi import envi_data_file
from common.data.convert.geotiff import GdalCube
from common.data.convert.layout import load_scene
from common.data.convert.matfile import load_class_names, load_mat_array, split_spec
from common.data.convert.raster import ArrayCube, Cube, GeoRef
from common.errors import DatasetError

TIFF_SUFFIXES = (".tif", ".tiff")


def source_format(spec: str) -> tuple[str, Path, str | None]:
    """Tell a scene file's format from its name.

    Args:
        spec: ``FILE.mat[:KEY]``, ``FILE.tif``/``.tiff`` (GeoTIFF), or ``FILE.hdr`` or the
            ENVI data file next to its ``.hdr``.

    Returns:
        ``(format, path, key)``: format ``mat``, ``envi`` or ``geotiff``; key only for .mat.

    Raises:
        DatasetError: the file is missing, its format is unknown, or a KEY is given for a
            format that has none.
    """
    path, key = split_spec(spec)
    suffix = path.suffix.lower()
    if suffix == ".mat":
        return "mat", path, key
    if not path.is_file():
        raise DatasetError(f"file {str(path)!r} does not exist")
    if key is not None:
        raise DatasetError(f"{spec!r}: a :KEY only applies to .mat files")
    if suffix in TIFF_SUFFIXES:
        return "geotiff", path, None
    if suffix == ".hdr" or any(
        Path(h).is_file() for h in (path.with_suffix(".hdr"), f"{path}.hdr")
    ):
        return "envi", path, None
    raise DatasetError(
        f"cannot tell the format of {str(path)!r}: expected FILE.mat[:KEY], a GeoTIFF "
        "(.tif, .tiff) or an ENVI header (.hdr) or data file with its .hdr beside it"
    )


def open_cube(spec: str, shape: tuple[int, int] | None = None, bands_first: bool = False) -> Cube:
    """Open a hyperspectral scene for reading by rows.

    .mat files (v5 and v7.3) are loaded whole, in any layout ``load_scene`` reads; ENVI and
    GeoTIFF files are read a window of rows at a time, so scenes larger than memory can be
    processed.

    Args:
        spec: see ``source_format``.
        shape: (rows, cols) of a bands x pixels .mat matrix (see ``load_scene``).
        bands_first: a .mat cube is (bands, rows, cols), or its matrix is bands x pixels.

    Returns:
        The open scene; close it (or use ``with``). ``layout`` says how a .mat array was read.

    Raises:
        DatasetError: the file is missing, unreadable or not a numeric cube in a known layout,
            or ``shape``/``bands_first`` is given for a file that is not .mat.
    """
    fmt, path, _ = source_format(spec)
    if fmt != "mat" and (shape is not None or bands_first):
        raise DatasetError(f"--shape and --bands-first apply to .mat cubes, not to {spec!r}")
    if fmt == "geotiff":
        return GdalCube(path)
    if fmt == "envi":
        return GdalCube(envi_data_file(path), "ENVI file", driver="ENVI")
    array, layout = load_scene(spec, shape, bands_first)
    cube = ArrayCube(array, spec)
    cube.layout = layout
    return cube


def load_labels(spec: str) -> tuple[np.ndarray, list[str] | None, GeoRef | None]:
    """Load a (rows, cols) class map: 0 = unlabelled, 1..K = classes.

    Args:
        spec: ``FILE.mat[:KEY]`` (class names from a ``class_names`` variable), a single-band
            GeoTIFF, or an ENVI classification file (class names from its header, whose first
            name is the unlabelled class 0).

    Returns:
        ``(labels, class_names or None, georef or None)``; labels as int64.

    Raises:
        DatasetError: the file is missing or unreadable, the map is not 2-D, or its labels
            are not non-negative integers.
    """
    fmt, path, _ = source_format(spec)
    if fmt == "mat":
        labels, names, georef = load_mat_array(spec), load_class_names(path), None
    else:
        with open_cube(spec) as cube:
            if cube.shape[2] != 1:
                raise DatasetError(
                    f"ground truth {spec!r} has {cube.shape[2]} bands; a class map has one"
                )
            labels = cube.read_rows(0, cube.shape[0])[..., 0]
            names, georef = cube.class_names, cube.georef
    if labels.ndim != 2:
        raise DatasetError(f"ground truth {spec!r} must be (rows, cols), got {labels.shape}")
    if labels.dtype.kind == "f" and not np.all(np.mod(labels, 1) == 0):
        raise DatasetError(
            f"ground truth {spec!r} has non-integer labels; for abundance maps add --gt-abundance"
        )
    if labels.size and labels.min() < 0:
        raise DatasetError(f"ground truth {spec!r} has negative label {labels.min()}")
    return labels.astype(np.int64), names, georef
