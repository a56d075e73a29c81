"""Hyperspectral scenes read by rows: .mat (whole), ENVI and GeoTIFF (windowed), class maps."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from common.errors import DatasetError

log = logging.getLogger(__name__)

MAT_SUFFIXES = (".mat",)
TIFF_SUFFIXES = (".tif", ".tiff")
ENVI_SUFFIXES = (".hdr",)
FORMATS = ("mat", "envi", "geotiff")


@dataclass(frozen=True)
class GeoRef:
    """Where a raster lies on the Earth.

    Attributes:
        crs: the coordinate reference system as WKT, or None when unknown.
        transform: the affine pixel-to-map transform ``(a, b, c, d, e, f)`` (x = a*col + b*row
            + c, y = d*col + e*row + f), or None.
    """

    crs: str | None
    transform: tuple[float, ...] | None


class Cube:
    """A (rows, cols, bands) scene that is read a band of rows at a time.

    Attributes:
        spec: what the user gave (``FILE[:KEY]``).
        shape: (rows, cols, bands).
        dtype: the stored sample type.
        georef: georeferencing when the file has it.
        windowed: True when ``read_rows`` reads only the rows asked for (ENVI, GeoTIFF);
            False when the whole scene is in memory (.mat).
    """

    spec: str
    shape: tuple[int, int, int]
    dtype: np.dtype
    georef: GeoRef | None = None
    windowed: bool = False

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start`` to ``stop`` (exclusive), every column and band.

        Args:
            start: first row.
            stop: one past the last row.

        Returns:
            A (stop - start, cols, bands) array of the stored dtype.

        Raises:
            DatasetError: the rows are out of range or cannot be read.
        """
        raise NotImplementedError

    def _check_rows(self, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.shape[0]:
            raise DatasetError(
                f"rows {start}:{stop} outside the {self.shape[0]} rows of {self.spec}"
            )

    def close(self) -> None:
        """Release the file."""

    def __enter__(self) -> Cube:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ArrayCube(Cube):
    """A scene held in memory (a .mat cube, or an array made by the caller)."""

    def __init__(self, array: np.ndarray, spec: str = "<array>") -> None:
        """Wrap ``array``.

        Args:
            array: (rows, cols, bands) numeric array.
            spec: a name for messages.

        Raises:
            DatasetError: the array is not 3-D and numeric.
        """
        if array.ndim != 3 or array.dtype.kind not in "biuf":
            raise DatasetError(
                f"cube {spec} must be a numeric (rows, cols, bands) array, "
                f"got {array.dtype} {array.shape}"
            )
        self.array = array
        self.spec = spec
        self.shape = (int(array.shape[0]), int(array.shape[1]), int(array.shape[2]))
        self.dtype = array.dtype

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the array (a view)."""
        self._check_rows(start, stop)
        return self.array[start:stop]


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
    from common.data.convert.matfile import split_spec

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
        from common.data.convert.matfile import load_mat_array

        array = load_mat_array(spec)
        if array.ndim != 3:
            raise DatasetError(
                f"cube {spec!r} must be (rows, cols, bands), got {array.shape}; a bands x "
                "pixels matrix needs nRow/nCol in the file or --shape ROWS,COLS"
            )
        return ArrayCube(array, spec)
    if fmt == "geotiff":
        from common.data.convert.geotiff import GeoTiffCube

        return GeoTiffCube(path)
    from common.data.convert.envi import EnviCube

    return EnviCube(path)


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
    names: list[str] | None = None
    georef: GeoRef | None = None
    if fmt == "mat":
        from common.data.convert.matfile import load_class_names, load_mat_array

        labels = load_mat_array(spec)
        names = load_class_names(path)
    elif fmt == "geotiff":
        from common.data.convert.geotiff import read_geotiff_labels

        labels, georef = read_geotiff_labels(path)
    else:
        from common.data.convert.envi import read_envi_labels

        labels, names = read_envi_labels(path)
    if labels.ndim != 2:
        raise DatasetError(f"ground truth {spec!r} must be (rows, cols), got {labels.shape}")
    if labels.dtype.kind == "f" and not np.all(np.mod(labels, 1) == 0):
        raise DatasetError(
            f"ground truth {spec!r} has non-integer labels; for abundance maps add --gt-abundance"
        )
    if labels.size and labels.min() < 0:
        raise DatasetError(f"ground truth {spec!r} has negative label {labels.min()}")
    return labels.astype(np.int64), names, georef
