"""What a map shows beside the classes: an RGB composite and the test pixels."""

from __future__ import annotations

import os
from collections.abc import Sequence

import h5py
import numpy as np

from common.data.convert.patches import rows_per_band
from common.data.convert.raster import Cube
from common.data.dataset import DatasetReader
from common.errors import DatasetError

STRETCH = (2.0, 98.0)  # percentiles mapped to 0 and 1 in a composite


def parse_bands(text: str, bands: int) -> tuple[int, int, int]:
    """Parse ``R,G,B`` (0-based band indices of the cube).

    Raises:
        DatasetError: not three integers in [0, bands).
    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise DatasetError(f"--rgb-bands must be R,G,B (three band indices), got {text!r}")
    r, g, b = (int(p) for p in parts)
    if max(r, g, b) >= bands:
        raise DatasetError(f"--rgb-bands {text!r}: the cube has bands 0..{bands - 1}")
    return r, g, b


def composite(cube: Cube, bands: Sequence[int]) -> np.ndarray:
    """Three bands as an RGB image, each stretched from its 2nd to its 98th percentile.

    Args:
        cube: the scene (read a band of rows at a time).
        bands: three band indices (red, green, blue).

    Returns:
        (rows, cols, 3) float32 in [0, 1].
    """
    rows, cols, nbands = cube.shape
    step = rows_per_band(cols, nbands, 1)
    parts = [
        np.asarray(cube.read_rows(s, min(rows, s + step))[:, :, list(bands)], dtype=np.float32)
        for s in range(0, rows, step)
    ]
    image = np.concatenate(parts)
    for k in range(3):
        channel = image[:, :, k]
        finite = channel[np.isfinite(channel)]
        low, high = np.percentile(finite, STRETCH) if finite.size else (0.0, 1.0)
        image[:, :, k] = (channel - low) / max(float(high - low), 1e-12)
    return np.clip(np.nan_to_num(image), 0.0, 1.0)


def dataset_pixels(
    path: str | os.PathLike[str], shape: tuple[int, int], fingerprint: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The test pixels of a prepared scene and the class map its file holds.

    Args:
        path: the dataset file the model was trained on (``prepare hsi`` output).
        shape: (rows, cols) of the scene being mapped.
        fingerprint: the model's training data; a different file is refused.

    Returns:
        ``(test_mask, labels)``: (rows, cols) bool, and (rows, cols) int64 with k + 1 for
        every pixel in the file (train or test) and 0 elsewhere.

    Raises:
        DatasetError: the file is not a scene's patches, is another scene, or is not the
            model's training data.
    """
    with DatasetReader(path, cache_bytes=0) as reader:
        meta = reader.meta
        if fingerprint is not None and meta.fingerprint != fingerprint:
            raise DatasetError(
                f"dataset {str(path)!r} (fingerprint {meta.fingerprint[:12]}) is not the data "
                f"the model was trained on ({fingerprint[:12]})"
            )
        stored = tuple(meta.attrs.get("image_shape") or ())
        if meta.kind != "hsi" or stored != tuple(shape):
            raise DatasetError(
                f"dataset {str(path)!r} holds no pixels of a {shape[0]}x{shape[1]} scene "
                f"(kind {meta.kind}, image_shape {list(stored)})"
            )
        labels = reader.labels
        test = reader.test_indices
    with h5py.File(path, "r") as f:
        if "coords" not in f:
            raise DatasetError(f"dataset {str(path)!r} has no /coords of its pixels")
        coords = np.asarray(f["coords"][...], dtype=np.int64)
    mask = np.zeros(shape, dtype=bool)
    mask[coords[test, 0], coords[test, 1]] = True
    gt = np.zeros(shape, dtype=np.int64)
    gt[coords[:, 0], coords[:, 1]] = labels + 1
    return mask, gt
