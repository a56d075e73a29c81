"""Hyperspectral scenes read by rows: .mat (whole), ENVI and GeoTIFF (windowed), class maps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data.convert.envi import envi_data_file
from common.data.convert.geotiff import GdalCube
from common.data.convert.matfile import load_class_names, load_mat_array, split_spec
from common.data.convert.raster import ArrayCube, Cube, GeoRef
from common.errors import DatasetError

MAT_SUFFIXES = (".mat",)
TIFF_SUFFIXES = (".tif", ".tiff")
ENVI_SUFFIXES = (".hdr",)
FORMATS = ("mat", "envi", "geotiff")


def source_format(spec: str) -> tuple[str, Path, str | None]:
    """Tell a scene file's format from its name.

    Args:
        spec: ``FILE.mat[:KEY]``, ``FILE.tif``/``.tiff`` (GeoTIFF), or ``FILE.hdr`` or the
            ENVI data file next to its ``.hdr``.

    Returns:
        ``(format, path, key)``; format is one of ``FORMATS``; key only for .mat.

    Raises:
        DatasetError: the file is missing, its format is unknown, or a KEY is given for a
            format that has none.
    """
    path, key = split_spec(spec)
    suffix = path.suffix.lower()
    if suffix in MAT_SUFFIXES:
        return "mat", path, key
    if not path.is_file():
        raise DatasetError(f"file {str(path)!r} does not exist")
    if key is not None:
        raise DatasetError(f"{spec!r}: a :KEY only applies to .mat files")
    if suffix in TIFF_SUFFIXES:
        return "geotiff", path, None
    if suffix in ENVI_SUFFIXES or path.with_suffix(".hdr").is_file():
        return "envi", path, None
    if Path(str(path) + ".hdr").is_file():
        return "envi", path, None
    raise DatasetError(
        f"cannot tell the format of {str(path)!r}: expected FILE.mat[:KEY], a GeoTIFF "
        "(.tif, .tiff) or an ENVI header (.hdr) or data file with its .hdr beside it"
    )


def open_cube(spec: str) -> Cube:
    """Open a hyperspectral scene for reading by rows.

    .mat files (v5 and v7.3) are loaded whole; ENVI and GeoTIFF files are read a window of
    rows at a time, so scenes larger than memory can be processed.

    Args:
        spec: see ``source_format``.

    Returns:
        The open scene; close it (or use ``with``).

    Raises:
        DatasetError: the file is missing, unreadable or not a 3-D numeric cube.
    """
    fmt, path, _ = source_format(spec)
    if fmt == "mat":
        array = load_mat_array(spec)
        if array.ndim != 3:
            raise DatasetError(
                f"cube {spec!r} must be (rows, cols, bands), got {array.shape}; a bands x "
                "pixels matrix needs nRow/nCol in the file or --shape ROWS,COLS"
            )
        return ArrayCube(array, spec)
    if fmt == "geotiff":
        return GdalCube(path)
    return GdalCube(envi_data_file(path), "ENVI file")


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
