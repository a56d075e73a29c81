"""Reflect-padded bands of rows of a scene, and the P x P patch windows inside them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from common.data.convert.raster import Cube

BAND_BYTES = 64 << 20  # float32 bytes of one padded band of rows; bounds streaming memory


def reflect_indices(indices: np.ndarray, size: int) -> np.ndarray:
    """Map indices outside [0, size) into it by mirroring at the edges, like
    ``np.pad(mode="reflect")`` (the edge itself is not repeated).

    Args:
        indices: integer indices, possibly negative or >= size.
        size: length of the axis (>= 1).

    Returns:
        The mirrored indices, int64.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if size == 1:
        return np.zeros_like(idx)
    period = 2 * (size - 1)
    idx = np.mod(idx, period)
    return np.where(idx >= size, period - idx, idx)


def rows_per_band(cols: int, bands: int, patch: int, budget: int | None = None) -> int:
    """How many output rows one band may hold so its padded float32 copy fits ``budget``
    (default ``BAND_BYTES``)."""
    budget = BAND_BYTES if budget is None else budget
    row_bytes = (cols + patch - 1) * bands * 4
    return max(1, budget // max(row_bytes, 1) - (patch - 1))


def padded_rows(cube: Cube, start: int, stop: int, pad: int) -> np.ndarray:
    """Rows ``start - pad`` to ``stop + pad`` and columns ``-pad`` to ``cols + pad``, reflected
    at the scene's edges, as float32.

    Only the rows needed are read from ``cube``.

    Args:
        cube: the scene.
        start: first output row.
        stop: one past the last output row.
        pad: rows and columns added on each side (P // 2 for P x P patches).

    Returns:
        A float32 (stop - start + 2 pad, cols + 2 pad, bands) array.

    Raises:
        DatasetError: the cube cannot be read.
    """
    rows, cols, bands = cube.shape
    wanted = reflect_indices(np.arange(start - pad, stop + pad), rows)
    lo, hi = int(wanted.min()), int(wanted.max()) + 1
    raw = cube.read_rows(lo, hi)
    # One float32 output, filled in place: the stored rows go into its middle columns
    # (converted on assignment), then the reflected columns are copied from them.
    out = np.empty((wanted.size, cols + 2 * pad, bands), dtype=np.float32)
    middle = out[:, pad : pad + cols]
    if np.array_equal(wanted, np.arange(lo, hi)):
        middle[...] = raw
    else:
        middle[...] = raw[wanted - lo]
    if pad:
        out[:, :pad] = middle[:, reflect_indices(np.arange(-pad, 0), cols)]
        out[:, pad + cols :] = middle[:, reflect_indices(np.arange(cols, cols + pad), cols)]
    return out


def iter_bands(
    cube: Cube,
    patch: int,
    mean: np.ndarray | None = None,
    std: np.ndarray | None = None,
    budget: int | None = None,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Walk the scene top to bottom in bands of rows with their patch windows.

    Args:
        cube: the scene.
        patch: patch side P (odd).
        mean: per-band mean subtracted (float32 arithmetic) when given.
        std: per-band std divided by when given (with ``mean``).
        budget: bytes of one padded band (default ``BAND_BYTES``).

    Returns:
        An iterator of ``(start, stop, windows)``: ``windows[r, c]`` is the float32 (bands, P, P)
        patch centred on pixel (start + r, c) (a view into one padded band). Delete ``windows``
        at the end of each step, so that only one band is in memory at a time.
    """
    rows, cols, bands = cube.shape
    step = rows_per_band(cols, bands, patch, budget)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        block = padded_rows(cube, start, stop, patch // 2)
        if mean is not None and std is not None:
            block -= mean.astype(np.float32)
            block /= std.astype(np.float32)
        yield start, stop, sliding_window_view(block, (patch, patch), axis=(0, 1))
        del block  # before the next band is read (callers drop their view too)
