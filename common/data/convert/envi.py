"""ENVI scenes (.hdr + data file) read with the ``spectral`` package, a window of rows at a time."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from common.data.convert.raster import Cube, GeoRef
from common.errors import DatasetError

log = logging.getLogger(__name__)


def _header_and_data(path: Path) -> tuple[Path, Path | None]:
    """The ``.hdr`` of an ENVI file given either the header or the data file."""
    if path.suffix.lower() == ".hdr":
        return path, None
    for header in (path.with_suffix(".hdr"), Path(str(path) + ".hdr")):
        if header.is_file():
            return header, path
    raise DatasetError(f"no ENVI header (.hdr) found for {str(path)!r}")


def _open(path: Path) -> Any:
    """Open an ENVI image with spectral (its SpyFile), turning errors into DatasetError."""
    import spectral.io.envi as envi

    header, data = _header_and_data(path)
    try:
        with warnings.catch_warnings():  # absurd sizes overflow in numpy: refused below
            warnings.simplefilter("ignore", RuntimeWarning)
            image = envi.open(str(header), None if data is None else str(data))
    except Exception as exc:  # spectral raises its own types, IOError and ValueError
        raise DatasetError(f"cannot read ENVI file {str(path)!r}: {exc}") from exc
    _check_size(image, path)
    return image


def _check_size(image: Any, path: Path) -> None:
    """Refuse a header whose dimensions need more bytes than its data file holds (a damaged
    or hostile header would otherwise size arrays of terabytes)."""
    rows, cols, bands = (int(n) for n in image.shape)
    itemsize = np.dtype(image.dtype).itemsize
    needed = int(image.offset) + rows * cols * bands * itemsize
    try:
        held = os.stat(image.filename).st_size
    except OSError as exc:
        raise DatasetError(f"cannot read ENVI file {str(path)!r}: {exc}") from exc
    if min(rows, cols, bands) < 1 or needed > held:
        raise DatasetError(
            f"ENVI header of {str(path)!r} describes {rows} x {cols} x {bands} "
            f"{np.dtype(image.dtype).name} values ({needed} bytes), but its data file "
            f"{str(image.filename)!r} holds {held} bytes"
        )


class EnviCube(Cube):
    """An ENVI cube (BSQ, BIL or BIP, any byte order); reads only the rows asked for."""

    windowed = True

    def __init__(self, path: Path) -> None:
        """Open ``path`` (the .hdr or the data file).

        Raises:
            DatasetError: the header or data file is missing or unreadable.
        """
        self.spec = str(path)
        self._image = _open(path)
        rows, cols, bands = (int(n) for n in self._image.shape)
        self.shape = (rows, cols, bands)
        self.dtype = np.dtype(self._image.dtype)
        if self.dtype.kind not in "biuf":
            raise DatasetError(f"ENVI file {self.spec!r} holds {self.dtype}, not numbers")
        self.georef = _georef_of(path)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop``, every column and band, as (rows, cols, bands)."""
        self._check_rows(start, stop)
        try:
            block = self._image.read_subregion((start, stop), (0, self.shape[1]))
        except Exception as exc:
            raise DatasetError(f"cannot read rows {start}:{stop} of {self.spec!r}: {exc}") from exc
        return np.asarray(block).reshape(stop - start, self.shape[1], self.shape[2])


def _georef_of(path: Path) -> GeoRef | None:
    """The map position of an ENVI file as GDAL (rasterio) reads its ``map info``, if any."""
    from common.data.convert.geotiff import georef_of_file

    _, data = _header_and_data(path)
    return georef_of_file(data) if data is not None else None


def read_envi_labels(path: Path) -> tuple[np.ndarray, list[str] | None]:
    """Read a single-band ENVI class map (e.g. an ENVI Classification file).

    Args:
        path: the .hdr or the data file.

    Returns:
        ``(labels (rows, cols), class names or None)``. The header's ``class names`` list
        starts with the unlabelled class 0 (ENVI's ``Unclassified``), which is dropped.

    Raises:
        DatasetError: the file is unreadable or has more than one band.
    """
    image = _open(path)
    if int(image.shape[2]) != 1:
        raise DatasetError(
            f"ground truth {str(path)!r} has {image.shape[2]} bands; a class map has one"
        )
    try:
        labels = np.asarray(image.read_band(0))
    except Exception as exc:
        raise DatasetError(f"cannot read ENVI file {str(path)!r}: {exc}") from exc
    names = image.metadata.get("class names")
    if isinstance(names, list) and len(names) >= 2:
        return labels, [str(n).strip() for n in names[1:]]
    return labels, None
