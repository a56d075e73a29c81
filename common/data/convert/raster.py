"""The scene types every reader returns: a cube read a band of rows at a time, held in memory
or read from a file, and where it lies on the Earth."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import DatasetError


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
        class_names: names of classes 1..K when the file holds a named class map.
        layout: how the stored array became (rows, cols, bands), when not stored so.
        windowed: True when ``read_rows`` reads only the rows asked for (ENVI, GeoTIFF);
            False when the whole scene is in memory (.mat).
    """

    spec: str
    shape: tuple[int, int, int]
    dtype: np.dtype
    georef: GeoRef | None = None
    class_names: list[str] | None = None
    layout: str | None = None
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

    def __exit__(self, *exc: object) -> None:
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
