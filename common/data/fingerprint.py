"""Dataset fingerprints (docs/data.md): sha256 over the stored samples, labels and splits."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from common.errors import DatasetError


def as_index_array(indices: Any, what: str) -> np.ndarray:
    """Return ``indices`` as a 1-D int64 array, or raise DatasetError."""
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DatasetError(
            f"{what} must be a 1-D integer array, got dtype {arr.dtype} shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


def digest(arr: np.ndarray) -> bytes:
    """sha256 digest of an array's little-endian, C-ordered bytes."""
    return hashlib.sha256(le_bytes(arr)).digest()


def le_bytes(arr: np.ndarray) -> bytes | memoryview:
    """The array's bytes in little-endian C order (what the fingerprint hashes)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.data.cast("B")


def combine_fingerprint(
    x_digest: bytes, y_digest: bytes, train_idx: np.ndarray, test_idx: np.ndarray
) -> str:
    """Combine the four parts of a dataset fingerprint (see docs/data.md).

    Args:
        x_digest: sha256 digest of all ``/x`` bytes as stored (little-endian, sample order).
        y_digest: sha256 digest of all ``/y`` bytes (int64 little-endian).
        train_idx: the training indices (int64).
        test_idx: the test indices (int64).

    Returns:
        The hex sha256 of the concatenated digests of x, y, train_idx and test_idx.
    """
    h = hashlib.sha256()
    for part in (
        x_digest,
        y_digest,
        digest(train_idx.astype(np.int64)),
        digest(test_idx.astype(np.int64)),
    ):
        h.update(part)
    return h.hexdigest()
