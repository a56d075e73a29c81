"""GeoTIFF scenes and class maps read and written with rasterio, keeping their georeferencing."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.data.convert.raster import Cube, GeoRef
from common.errors import DatasetError

log = logging.getLogger(__name__)

# GDAL keeps read blocks in a cache of 5 % of RAM by default, which would undo windowed reads'
# memory bound; a cube open for row-band reads gets this many MB instead.
GDAL_CACHE_MB = 32


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide rasterio's warning about files without georeferencing (they are fine here)."""
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        yield


def _georef(dataset: Any) -> GeoRef | None:
    """GeoRef of an open rasterio dataset; None when it has neither CRS nor a transform."""
    from rasterio.transform import Affine

    crs = dataset.crs.to_wkt() if dataset.crs else None
    transform: tuple[float, ...] | None = tuple(float(v) for v in tuple(dataset.transform)[:6])
    if transform == tuple(float(v) for v in tuple(Affine.identity())[:6]):
        transform = None
    if crs is None and transform is None:
        return None
    return GeoRef(crs=crs, transform=transform)


def georef_of_file(path: Path) -> GeoRef | None:
    """The georeferencing of any raster GDAL reads, or None when it has none or is unreadable."""
    import rasterio

    try:
        with _quiet(), rasterio.open(path) as dataset:
            return _georef(dataset)
    except rasterio.errors.RasterioError as exc:
        log.debug("no georeferencing read from %s: %s", path, exc)
        return None


class GeoTiffCube(Cube):
    """A multi-band GeoTIFF, one band per spectral band; reads only the rows asked for."""

    windowed = True

    def __init__(self, path: Path) -> None:
        """Open ``path``.

        Raises:
            DatasetError: the file is not a readable raster or its bands differ in type.
        """
        import rasterio

        self.spec = str(path)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_MB))
        try:
            with _quiet():
                self._dataset = self._stack.enter_context(rasterio.open(path))
        except rasterio.errors.RasterioError as exc:
            self._stack.close()
            raise DatasetError(f"cannot read GeoTIFF {self.spec!r}: {exc}") from exc
        ds = self._dataset
        if len(set(ds.dtypes)) != 1:
            self._stack.close()
            raise DatasetError(f"GeoTIFF {self.spec!r} mixes band types {sorted(set(ds.dtypes))}")
        self.shape = (int(ds.height), int(ds.width), int(ds.count))
        self.dtype = np.dtype(ds.dtypes[0])
        self.georef = _georef(ds)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop``, every column and band, as (rows, cols, bands)."""
        from rasterio.windows import Window

        self._check_rows(start, stop)
        window = Window(0, start, self.shape[1], stop - start)
        try:
            with _quiet():
                block = self._dataset.read(window=window)
        except Exception as exc:
            raise DatasetError(f"cannot read rows {start}:{stop} of {self.spec!r}: {exc}") from exc
        return np.moveaxis(block, 0, -1)

    def close(self) -> None:
        """Close the file (and GDAL's settings for it)."""
        self._stack.close()


def read_geotiff_labels(path: Path) -> tuple[np.ndarray, GeoRef | None]:
    """Read a single-band GeoTIFF class map.

    Returns:
        ``(labels (rows, cols), georef or None)``.

    Raises:
        DatasetError: the file is unreadable or has more than one band.
    """
    import rasterio

    try:
        with _quiet(), rasterio.open(path) as dataset:
            if dataset.count != 1:
                raise DatasetError(
                    f"ground truth {str(path)!r} has {dataset.count} bands; a class map has one"
                )
            return dataset.read(1), _georef(dataset)
    except rasterio.errors.RasterioError as exc:
        raise DatasetError(f"cannot read GeoTIFF {str(path)!r}: {exc}") from exc


def write_class_geotiff(
    path: Path,
    classes: np.ndarray,
    georef: GeoRef | None,
    class_names: Sequence[str],
    colours: Sequence[tuple[int, int, int]],
) -> None:
    """Write a class map as a single-band GeoTIFF: 0 = no data, class k stored as k + 1.

    The band carries a colour table (one colour per class) and the class names (tag
    ``CLASS_NAMES``, a JSON list, and ``CLASS_<k+1>`` per class).

    Args:
        path: the file to write.
        classes: (rows, cols) class indices 0..K-1 (K or more: no data, stored as 0).
        georef: the input's georeferencing (CRS and transform), kept as is; None writes none.
        class_names: K names.
        colours: K RGB colours (0-255).

    Raises:
        DatasetError: the file cannot be written.
    """
    import rasterio
    from rasterio.transform import Affine

    k = len(class_names)
    dtype = np.uint8 if k < 255 else np.uint16
    profile: dict[str, Any] = {
        "driver": "GTiff",
        "height": int(classes.shape[0]),
        "width": int(classes.shape[1]),
        "count": 1,
        "dtype": np.dtype(dtype).name,
        "nodata": 0,
        "compress": "deflate",
    }
    if georef is not None and georef.crs is not None:
        profile["crs"] = rasterio.crs.CRS.from_wkt(georef.crs)
    if georef is not None and georef.transform is not None:
        profile["transform"] = Affine(*georef.transform)
    tags = {"CLASS_NAMES": json.dumps(list(class_names))}
    tags.update({f"CLASS_{i + 1}": name for i, name in enumerate(class_names)})
    try:
        with _quiet(), rasterio.open(path, "w", **profile) as out:
            stored = np.where(classes < k, classes.astype(np.int64) + 1, 0)  # K+: no data
            out.write(stored.astype(dtype), 1)
            if dtype == np.uint8:
                table = {0: (0, 0, 0, 0)}
                table.update({i + 1: (*c, 255) for i, c in enumerate(colours)})
                out.write_colormap(1, table)
            out.update_tags(1, **tags)
    except rasterio.errors.RasterioError as exc:
        raise DatasetError(f"cannot write GeoTIFF {str(path)!r}: {exc}") from exc
