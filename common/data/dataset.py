"""The HDF5 dataset format: a streaming writer, a thread-safe reader and a summary function."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.data.codec import FLOAT_DTYPES, STORED_DTYPES, SampleCodec
from common.data.fingerprint import as_index_array, combine_fingerprint, digest, le_bytes
from common.errors import DatasetError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: /x float32, normalised
KINDS = ("hsi", "scenes")
SPLITS = ("train", "test")
_REQUIRED_ATTRS = ("format_version", "kind", "class_names", "num_classes", "fingerprint")


@dataclass(frozen=True)
class DatasetMeta:
    """What a dataset file holds, read from its attributes and splits."""

    path: str
    kind: str
    shape: tuple[int, int, int]
    num_samples: int
    num_classes: int
    class_names: tuple[str, ...]
    train_count: int
    test_count: int
    fingerprint: str
    class_counts: dict[str, list[int]]
    source: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)


def _decode_attr(value: Any) -> Any:
    """Turn an h5py attribute into a plain Python value."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


class DatasetReader:
    """Read samples from a dataset file; safe to use from any thread.

    The whole ``/x`` is loaded into memory on the first ``read`` when it fits in
    ``cache_bytes``; otherwise each ``read`` goes to the file.
    """

    def __init__(self, path: str | os.PathLike[str], cache_bytes: int = 1 << 30) -> None:
        """Open ``path`` read-only and validate its layout.

        Args:
            path: the dataset file.
            cache_bytes: load ``/x`` into memory if it is at most this many bytes.

        Raises:
            DatasetError: the file is missing, not HDF5, or its layout is wrong.
        """
        self.path = Path(path)
        self.cache_bytes = int(cache_bytes)
        self._lock = threading.Lock()
        self._cache: np.ndarray | None = None
        if not self.path.is_file():
            raise DatasetError(f"dataset file {str(self.path)!r} does not exist")
        try:
            self._file: h5py.File | None = h5py.File(self.path, "r")
        except OSError as exc:
            raise DatasetError(f"{str(self.path)!r} is not a readable HDF5 file: {exc}") from exc
        try:
            self._validate()
        except (ValueError, TypeError, KeyError, OSError, RuntimeError) as exc:
            # what h5py and numpy raise for a value of another kind, or a link that leads
            # nowhere or in circles
            self.close()
            raise self._fail(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> DatasetError:
        return DatasetError(f"{str(self.path)!r} is not a valid dataset file: {what}")

    def _validate(self) -> None:
        f = self._file
        assert f is not None
        for name in ("x", "y", "train_idx", "test_idx"):
            if not isinstance(f.get(name), h5py.Dataset):
                raise self._fail(f"dataset /{name} is missing (found {sorted(f.keys())})")
        missing = [a for a in _REQUIRED_ATTRS if a not in f.attrs]
        if missing:
            raise self._fail(f"root attributes {missing} are missing")
        version = _decode_attr(f.attrs["format_version"])
        if version not in READABLE_VERSIONS:
            raise self._fail(f"format_version is {version!r}, this code reads {READABLE_VERSIONS}")
        kind = _decode_attr(f.attrs["kind"])
        if kind not in KINDS:
            raise self._fail(f"kind is {kind!r}, expected one of {KINDS}")
        x, y = f["x"], f["y"]
        dtypes = ("float32",) if version == 1 else STORED_DTYPES
        if x.ndim != 4 or x.dtype.name not in dtypes or x.dtype.byteorder == ">":
            raise self._fail(f"/x must be one of {dtypes} (N, C, H, W), got {x.dtype} {x.shape}")
        n = x.shape[0]
        if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
            raise self._fail(f"/y must be integers of shape ({n},), got {y.dtype} {y.shape}")
        try:
            names = json.loads(_decode_attr(f.attrs["class_names"]))
        except (TypeError, ValueError) as exc:
            raise self._fail(f"class_names is not a JSON list: {exc}") from exc
        num_classes = int(_decode_attr(f.attrs["num_classes"]))
        if not isinstance(names, list) or len(names) != num_classes:
            raise self._fail(f"class_names {names!r} does not list num_classes={num_classes}")
        self._y = np.asarray(y[...], dtype=np.int64)
        if n and (self._y.min() < 0 or self._y.max() >= num_classes):
            raise self._fail(f"/y has labels outside [0, {num_classes})")
        splits = {}
        for split in SPLITS:
            idx = np.asarray(f[f"{split}_idx"][...])
            if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
                raise self._fail(f"/{split}_idx must be a 1-D integer array")
            idx = idx.astype(np.int64)
            if idx.size and (idx[0] < 0 or idx[-1] >= n or np.any(np.diff(idx) <= 0)):
                raise self._fail(f"/{split}_idx must be sorted, unique and within [0, {n})")
            splits[split] = idx
        if np.intersect1d(splits["train"], splits["test"]).size:
            raise self._fail("/train_idx and /test_idx overlap")
        self._y.flags.writeable = False
        for arr in splits.values():
            arr.flags.writeable = False
        self._splits = splits
        counts = {
            s: np.bincount(self._y[ix], minlength=num_classes).tolist() for s, ix in splits.items()
        }
        known = {"format_version", "kind", "class_names", "num_classes", "fingerprint", "source"}
        known.add("normalise_on_read")
        extra = {k: _decode_attr(v) for k, v in f.attrs.items() if k not in known}
        self._raw_chunks = (
            x.chunks == (1, *x.shape[1:])
            and not x.compression
            and not x.shuffle
            and not x.fletcher32
        )
        self.norm_mean = np.asarray(f["norm_mean"][...]) if "norm_mean" in f else None
        self.norm_std = np.asarray(f["norm_std"][...]) if "norm_std" in f else None
        self.codec = self._codec(
            x.dtype.name, bool(_decode_attr(f.attrs.get("normalise_on_read", 0)))
        )
        if self.codec.mean is not None and self.codec.mean.shape != (x.shape[1],):
            raise self._fail(
                f"/norm_mean and /norm_std hold {self.codec.mean.shape[0]} bands' statistics, "
                f"/x has {x.shape[1]} bands"
            )
        self.meta = DatasetMeta(
            path=str(self.path),
            kind=kind,
            shape=(int(x.shape[1]), int(x.shape[2]), int(x.shape[3])),
            num_samples=int(n),
            num_classes=num_classes,
            class_names=tuple(str(c) for c in names),
            train_count=int(splits["train"].size),
            test_count=int(splits["test"].size),
            fingerprint=str(_decode_attr(f.attrs["fingerprint"])),
            class_counts=counts,
            source=str(_decode_attr(f.attrs.get("source", ""))),
            attrs=extra,
        )

    def _codec(self, dtype: str, on_read: bool) -> SampleCodec:
        """How ``/x`` becomes model input; raw integers are always normalised on read."""
        if dtype in FLOAT_DTYPES and not on_read:
            return SampleCodec(dtype)
        if self.norm_mean is None or self.norm_std is None:
            raise self._fail(
                f"/x is {dtype} normalised on read, but /norm_mean or /norm_std is missing"
            )
        try:
            return SampleCodec(dtype, self.norm_mean, self.norm_std)
        except DatasetError as exc:
            raise self._fail(str(exc)) from exc

    @property
    def train_indices(self) -> np.ndarray:
        """Sorted int64 indices of the training split (read-only, not copied)."""
        return self._splits["train"]

    @property
    def test_indices(self) -> np.ndarray:
        """Sorted int64 indices of the test split (read-only, not copied)."""
        return self._splits["test"]

    @property
    def labels(self) -> np.ndarray:
        """All labels (N,) int64 (read-only, not copied)."""
        return self._y

    def _x_nbytes(self) -> int:
        n, c, h, w = (self.meta.num_samples, *self.meta.shape)
        return n * c * h * w * self.codec.itemsize

    def read(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Read samples in the order given as model input; indices may repeat.

        Args:
            indices: 1-D integer indices into the dataset.

        Returns:
            ``(x, y)``: float32 (n, C, H, W) normalised and int64 (n,), in the order of
            ``indices``.

        Raises:
            DatasetError: an index is out of range, or the reader is closed.
        """
        x, y = self.read_stored(indices)
        return self.codec.decode(x), y

    def read_stored(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Like ``read``, but ``x`` as stored (``codec.dtype``, not normalised on read)."""
        idx = as_index_array(indices, "indices")
        n = self.meta.num_samples
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(idx.min() if idx.min() < 0 else idx.max())
            raise DatasetError(f"index {bad} outside [0, {n}) in {str(self.path)!r}")
        y = self._y[idx]
        if idx.size == 0:
            return np.zeros((0, *self.meta.shape), dtype=self.codec.dtype), y
        with self._lock:
            if self._file is None:
                raise DatasetError(f"reader for {str(self.path)!r} is closed")
            if self._cache is None and self._x_nbytes() <= self.cache_bytes:
                log.debug("caching %s (%d bytes) in memory", self.path, self._x_nbytes())
                self._cache = np.asarray(self._file["x"][...])
            if self._cache is None:
                uniq, inverse = np.unique(idx, return_inverse=True)
                data = self._read_rows(uniq)
        if self._cache is not None:
            return self._cache[idx], y
        if uniq.size == idx.size and bool(np.all(idx[1:] > idx[:-1])):
            return data, y  # already sorted and unique (e.g. a split's indices): no reorder copy
        return data[inverse.reshape(-1)], y

    def _read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Read sorted unique samples from the file (caller holds the lock).

        h5py's fancy indexing costs about 0.3 ms per index, so unfiltered one-sample chunks
        (what DatasetWriter makes) are read raw, and other layouts run by contiguous run.
        """
        assert self._file is not None
        x = self._file["x"]
        dtype = np.dtype(self.codec.dtype).newbyteorder("<")
        out = np.empty((rows.size, *self.meta.shape), dtype=dtype)
        if self._raw_chunks:
            try:
                for k, i in enumerate(rows.tolist()):
                    mask, buf = x.id.read_direct_chunk((i, 0, 0, 0))
                    if mask:
                        raise OSError("chunk has filters applied")
                    out[k] = np.frombuffer(buf, dtype=dtype).reshape(self.meta.shape)
                return out
            except (OSError, ValueError) as exc:
                log.debug("raw chunk reads fail on %s (%s); slicing instead", self.path, exc)
                self._raw_chunks = False
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run in np.split(np.arange(rows.size), breaks):
            lo, hi = int(rows[run[0]]), int(rows[run[-1]]) + 1
            out[run[0] : run[-1] + 1] = x[lo:hi]
        return out

    def iter_blocks(
        self, indices: Any, block: int = 1024
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``read`` results for consecutive slices of ``indices``.

        Args:
            indices: 1-D integer indices, e.g. ``test_indices``.
            block: samples per yielded block.

        Returns:
            An iterator of ``(x, y)`` blocks of at most ``block`` samples.

        Raises:
            DatasetError: ``block`` is not positive or an index is out of range.
        """
        if block < 1:
            raise DatasetError(f"block must be >= 1, got {block}")
        idx = as_index_array(indices, "indices")
        for start in range(0, idx.size, block):
            yield self.read(idx[start : start + block])

    def verify(self, block: int = 1024) -> bool:
        """Recompute the fingerprint from the file's contents.

        Args:
            block: samples read at a time.

        Returns:
            True when the stored fingerprint matches the contents.

        Raises:
            DatasetError: the reader is closed.
        """
        xh = hashlib.sha256()
        every = np.arange(self.meta.num_samples)
        for start in range(0, every.size, max(block, 1)):
            xh.update(le_bytes(self.read_stored(every[start : start + block])[0]))
        found = combine_fingerprint(
            xh.digest(), digest(self._y), self._splits["train"], self._splits["test"]
        )
        return found == self.meta.fingerprint

    def close(self) -> None:
        """Close the file and drop the cache; later reads raise DatasetError."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._cache = None

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarise a dataset file as JSON-ready data.

    Args:
        path: the dataset file.

    Returns:
        ``{"path", "kind", "samples", "classes", "class_names", "shape", "stored_dtype",
        "normalise_on_read", "fingerprint", "source", "counts": {"train", "test",
        "per_class": {"train": [...], "test": [...]}}, "attrs"}``.

    Raises:
        DatasetError: the file is missing or invalid.
    """
    with DatasetReader(path, cache_bytes=0) as reader:
        m = reader.meta
        return {
            "path": m.path,
            "kind": m.kind,
            "samples": m.num_samples,
            "classes": m.num_classes,
            "class_names": list(m.class_names),
            "shape": list(m.shape),
            "stored_dtype": reader.codec.dtype,
            "normalise_on_read": reader.codec.normalises,
            "fingerprint": m.fingerprint,
            "source": m.source,
            "counts": {
                "train": m.train_count,
                "test": m.test_count,
                "per_class": {s: list(c) for s, c in m.class_counts.items()},
            },
            "attrs": dict(m.attrs),
        }
