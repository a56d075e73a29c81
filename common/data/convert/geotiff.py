"""Rasters via rasterio (GDAL): GeoTIFF and ENVI scenes read by rows; class-map GeoTIFFs written."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.data.convert.envi import check_size
from common.data.convert.raster import Cube, GeoRef
from common.errors import DatasetError

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


class GdalCube(Cube):
    """A multi-band raster GDAL reads (GeoTIFF, ENVI), one band per spectral band; reads only
    the rows asked for.

    Attributes:
        class_names: an ENVI classification header's class names without its unlabelled
            class 0, else None.
    """

    windowed = True

    def __init__(self, path: Path, what: str = "GeoTIFF", *, driver: str | None = None) -> None:
        """Open ``path``.

        Args:
            path: the raster (for ENVI, the data file beside its .hdr).
            what: the format's name in messages.
            driver: the GDAL driver to open it with (None: GDAL picks); with ``ENVI`` the
                header GDAL read is checked against the data file's size.

        Raises:
            DatasetError: the file is not a readable raster, its bands are not numbers of
                one type, or (ENVI) its header describes more data than the file holds.
        """
        import rasterio

        self.spec = str(path)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_MB))
        try:
            with _quiet():
                self._dataset = ds = self._stack.enter_context(rasterio.open(path, driver=driver))
            if len(set(ds.dtypes)) != 1 or np.dtype(ds.dtypes[0]).kind not in "biuf":
                raise DatasetError(
                    f"{what} {self.spec!r} holds {set(ds.dtypes)}: not one numeric type"
                )
            self.shape = (int(ds.height), int(ds.width), int(ds.count))
            self.dtype = np.dtype(ds.dtypes[0])
            if driver == "ENVI":
                offset = ds.tags(ns="ENVI").get("header_offset", 0)
                check_size(path, path, self.shape, self.dtype, offset)
        except BaseException as exc:
            self._stack.close()
            if isinstance(exc, rasterio.errors.RasterioError):
                raise DatasetError(f"cannot read {what} {self.spec!r}: {exc}") from exc
            raise
        self.georef = _georef(ds)
        names = ds.tags(ns="ENVI").get("class_names", "").strip("{} ").split(",")
        self.class_names = [n.strip() for n in names[1:]] if len(names) >= 2 else None

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
