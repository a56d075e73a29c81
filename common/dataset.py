"""The HDF5 dataset format: a streaming writer, a thread-safe reader and a summary function."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import numpy as np

from common.errors import DatasetError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KINDS = ("hsi", "scenes")
SPLITS = ("train", "test")
_REQUIRED_ATTRS = ("format_version", "kind", "class_names", "num_classes", "fingerprint")


def _as_index_array(indices: Any, what: str) -> np.ndarray:
    """Return ``indices`` as a 1-D int64 array, or raise DatasetError."""
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DatasetError(
            f"{what} must be a 1-D integer array, got dtype {arr.dtype} shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


def _digest(arr: np.ndarray) -> bytes:
    """sha256 digest of an array's little-endian, C-ordered bytes."""
    return hashlib.sha256(_le_bytes(arr)).digest()


def _le_bytes(arr: np.ndarray) -> bytes | memoryview:
    """The array's bytes in little-endian C order (what the fingerprint hashes)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return memoryview(arr).cast("B")


def combine_fingerprint(
    x_digest: bytes, y_digest: bytes, train_idx: np.ndarray, test_idx: np.ndarray
) -> str:
    """Combine the four parts of a dataset fingerprint (see docs/data.md).

    Args:
        x_digest: sha256 digest of all ``/x`` bytes (float32 little-endian, sample order).
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
        _digest(train_idx.astype(np.int64)),
        _digest(test_idx.astype(np.int64)),
    ):
        h.update(part)
    return h.hexdigest()


def _check_split(idx: np.ndarray, n: int, name: str) -> np.ndarray:
    """Sort a split's indices and check range and uniqueness."""
    idx = np.sort(_as_index_array(idx, name))
    if idx.size and (idx[0] < 0 or idx[-1] >= n):
        bad = idx[0] if idx[0] < 0 else idx[-1]
        raise DatasetError(f"{name} contains index {int(bad)} outside [0, {n})")
    if idx.size > 1 and np.any(idx[1:] == idx[:-1]):
        dup = idx[1:][idx[1:] == idx[:-1]][0]
        raise DatasetError(f"{name} contains index {int(dup)} more than once")
    return idx


def stratified_split(
    y: np.ndarray, train_fraction: float, seed: int, num_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices per class at random, deterministically from ``seed``.

    Each class with n samples gets ``round(train_fraction * n)`` training samples, at least 1
    and, when n >= 2, at most n - 1 (so every class present is in both splits if it can be).

    Args:
        y: labels (N,) in [0, num_classes).
        train_fraction: fraction of each class used for training, in (0, 1).
        seed: seed of the random permutation.
        num_classes: number of classes (default ``y.max() + 1``).

    Returns:
        ``(train_idx, test_idx)``: sorted, disjoint int64 arrays that together cover 0..N-1.

    Raises:
        DatasetError: ``train_fraction`` is not in (0, 1).
    """
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    y = np.asarray(y, dtype=np.int64)
    k = int(num_classes if num_classes is not None else (y.max() + 1 if y.size else 0))
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for c in range(k):
        members = np.flatnonzero(y == c)
        n = members.size
        if n == 0:
            continue
        n_train = max(1, round(train_fraction * n))
        if n >= 2:
            n_train = min(n_train, n - 1)
        perm = rng.permutation(members)
        train.append(perm[:n_train])
        test.append(perm[n_train:])
    empty = np.zeros(0, dtype=np.int64)
    tr = np.sort(np.concatenate(train)) if train else empty
    te = np.sort(np.concatenate(test)) if test else empty
    return tr.astype(np.int64), te.astype(np.int64)


def _attr_value(value: Any) -> Any:
    """Convert a Python value into something h5py stores as an attribute."""
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in value
    ):
        return np.asarray(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    if value is None:
        return "null"
    return value


class DatasetWriter:
    """Stream samples into a new dataset file, written atomically.

    Data goes to a temporary file next to ``path``; ``close`` writes the splits and the
    fingerprint and renames it into place. Leaving the ``with`` block with an exception, or
    without calling ``close``, removes the temporary file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        shape: Sequence[int],
        num_samples: int,
        kind: str,
        class_names: Sequence[str],
        source: str = "",
    ) -> None:
        """Create the temporary file and its datasets.

        Args:
            path: where the finished file goes (any existing file is replaced at ``close``).
            shape: the shape (C, H, W) of one sample.
            num_samples: how many samples ``write`` will receive in total.
            kind: ``"hsi"`` or ``"scenes"``.
            class_names: one name per class; labels are 0..len(class_names)-1.
            source: free text saying where the data came from.

        Raises:
            DatasetError: an argument is invalid or the file cannot be created.
        """
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) != 3 or min(self.shape) < 1:
            raise DatasetError(f"sample shape must be (C, H, W) with positive sizes, got {shape}")
        if num_samples < 1:
            raise DatasetError(f"num_samples must be >= 1, got {num_samples}")
        if kind not in KINDS:
            raise DatasetError(f"kind must be one of {KINDS}, got {kind!r}")
        if len(class_names) < 1:
            raise DatasetError("class_names is empty: a dataset needs at least one class")
        self.num_samples = int(num_samples)
        self.kind = kind
        self.class_names = [str(c) for c in class_names]
        self.source = source
        self._written = 0
        self._x_hash = hashlib.sha256()
        self._y_hash = hashlib.sha256()
        self._file: h5py.File | None = None
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if not parent.is_dir():
            raise DatasetError(f"output folder {str(parent)!r} does not exist")
        # A fresh unique name rather than mkstemp, so the file gets the usual umask permissions.
        self._tmp = parent / f".{self.path.name}.{uuid.uuid4().hex}.tmp"
        try:
            self._file = h5py.File(self._tmp, "x")
            self._x = self._file.create_dataset(
                "x", shape=(self.num_samples, *self.shape), dtype="<f4", chunks=(1, *self.shape)
            )
            self._y = self._file.create_dataset("y", shape=(self.num_samples,), dtype="<i8")
        except Exception as exc:
            self.abort()
            raise DatasetError(
                f"cannot create dataset file next to {str(self.path)!r}: {exc}"
            ) from exc

    @property
    def written(self) -> int:
        """How many samples have been written so far."""
        return self._written

    def write(self, x_block: np.ndarray, y_block: np.ndarray) -> None:
        """Append a block of samples after those already written.

        Args:
            x_block: float array (n, C, H, W); converted to float32.
            y_block: integer labels (n,) in [0, num_classes).

        Raises:
            DatasetError: the writer is closed, shapes or labels are wrong, values are not
                finite, or the block would exceed ``num_samples``.
        """
        if self._file is None:
            raise DatasetError(f"writer for {str(self.path)!r} is already closed")
        x = np.ascontiguousarray(x_block, dtype=np.float32)
        y = np.asarray(y_block)
        n = x.shape[0] if x.ndim else 0
        if x.shape[1:] != self.shape or x.ndim != 4:
            raise DatasetError(f"x block shape {x.shape} does not match (n, *{self.shape})")
        if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(
                f"y block must be integers of shape ({n},), got {y.dtype} shape {y.shape}"
            )
        y = np.ascontiguousarray(y, dtype=np.int64)
        if n and (y.min() < 0 or y.max() >= len(self.class_names)):
            bad = int(y.min() if y.min() < 0 else y.max())
            raise DatasetError(f"label {bad} outside [0, {len(self.class_names)})")
        if self._written + n > self.num_samples:
            raise DatasetError(
                f"writing {n} more samples after {self._written} exceeds "
                f"num_samples={self.num_samples}"
            )
        if not np.all(np.isfinite(x)):
            raise DatasetError(f"x block starting at sample {self._written} has NaN or Inf")
        start = self._written
        self._x[start : start + n] = x
        self._y[start : start + n] = y
        self._x_hash.update(_le_bytes(x))
        self._y_hash.update(_le_bytes(y))
        self._written += n

    def close(
        self,
        train_idx: Any,
        test_idx: Any,
        extra_attrs: dict[str, Any] | None = None,
        norm_mean: np.ndarray | None = None,
        norm_std: np.ndarray | None = None,
        extra_datasets: dict[str, np.ndarray] | None = None,
    ) -> str:
        """Write the splits, attributes and fingerprint, then move the file into place.

        Args:
            train_idx: training sample indices (any order; stored sorted).
            test_idx: test sample indices, disjoint from ``train_idx``.
            extra_attrs: more root attributes (dicts and lists are stored as JSON text).
            norm_mean: per-band mean (C,) subtracted from the data, stored as ``/norm_mean``.
            norm_std: per-band std (C,) the data was divided by, stored as ``/norm_std``.
            extra_datasets: more root datasets, e.g. ``{"coords": (N, 2) array}``; names must
                not clash with the layout's own.

        Returns:
            The dataset fingerprint (hex sha256).

        Raises:
            DatasetError: fewer samples were written than promised, or the splits are invalid.
        """
        if self._file is None:
            raise DatasetError(f"writer for {str(self.path)!r} is already closed")
        try:
            if self._written != self.num_samples:
                raise DatasetError(
                    f"only {self._written} of num_samples={self.num_samples} samples were written"
                )
            train = _check_split(train_idx, self.num_samples, "train_idx")
            test = _check_split(test_idx, self.num_samples, "test_idx")
            common = np.intersect1d(train, test)
            if common.size:
                raise DatasetError(
                    f"train_idx and test_idx share {common.size} indices, e.g. {int(common[0])}"
                )
            f = self._file
            f.create_dataset("train_idx", data=train, dtype="<i8")
            f.create_dataset("test_idx", data=test, dtype="<i8")
            for name, arr in (("norm_mean", norm_mean), ("norm_std", norm_std)):
                if arr is None:
                    continue
                arr = np.asarray(arr, dtype=np.float32)
                if arr.shape != (self.shape[0],):
                    raise DatasetError(
                        f"{name} must have shape ({self.shape[0]},), got {arr.shape}"
                    )
                f.create_dataset(name, data=arr)
            for name, arr in (extra_datasets or {}).items():
                if name in f or name in ("norm_mean", "norm_std"):
                    raise DatasetError(f"extra dataset name {name!r} clashes with the layout")
                f.create_dataset(name, data=np.asarray(arr))
            fingerprint = combine_fingerprint(
                self._x_hash.digest(), self._y_hash.digest(), train, test
            )
            for key, value in (extra_attrs or {}).items():
                f.attrs[key] = _attr_value(value)
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = self.kind
            f.attrs["class_names"] = json.dumps(self.class_names)
            f.attrs["num_classes"] = len(self.class_names)
            f.attrs["fingerprint"] = fingerprint
            f.attrs["source"] = self.source
            f.close()
            self._file = None
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        log.info("wrote %s: %d samples, fingerprint %s", self.path, self.num_samples, fingerprint)
        return fingerprint

    def abort(self) -> None:
        """Close and delete the temporary file without producing ``path``."""
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._file is None:
            return
        self.abort()
        if exc_type is None:
            raise DatasetError(f"writer for {str(self.path)!r} left without close(); file removed")


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
        if version != FORMAT_VERSION:
            raise self._fail(f"format_version is {version!r}, this code reads {FORMAT_VERSION}")
        kind = _decode_attr(f.attrs["kind"])
        if kind not in KINDS:
            raise self._fail(f"kind is {kind!r}, expected one of {KINDS}")
        x, y = f["x"], f["y"]
        if x.ndim != 4 or x.dtype != np.float32:
            raise self._fail(f"/x must be float32 (N, C, H, W), got {x.dtype} {x.shape}")
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
        extra = {k: _decode_attr(v) for k, v in f.attrs.items() if k not in known}
        self._raw_chunks = (
            x.chunks == (1, *x.shape[1:])
            and not x.compression
            and not x.shuffle
            and not x.fletcher32
            and x.dtype == np.dtype("<f4")
        )
        self.norm_mean = np.asarray(f["norm_mean"][...]) if "norm_mean" in f else None
        self.norm_std = np.asarray(f["norm_std"][...]) if "norm_std" in f else None
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
        return n * c * h * w * 4

    def read(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Read samples in the order given; indices may repeat.

        Args:
            indices: 1-D integer indices into the dataset.

        Returns:
            ``(x, y)``: float32 (n, C, H, W) and int64 (n,), in the order of ``indices``.

        Raises:
            DatasetError: an index is out of range, or the reader is closed.
        """
        idx = _as_index_array(indices, "indices")
        n = self.meta.num_samples
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(idx.min() if idx.min() < 0 else idx.max())
            raise DatasetError(f"index {bad} outside [0, {n}) in {str(self.path)!r}")
        y = self._y[idx]
        if idx.size == 0:
            return np.zeros((0, *self.meta.shape), dtype=np.float32), y
        with self._lock:
            if self._file is None:
                raise DatasetError(f"reader for {str(self.path)!r} is closed")
            if self._cache is None and self._x_nbytes() <= self.cache_bytes:
                log.debug("caching %s (%d bytes) in memory", self.path, self._x_nbytes())
                self._cache = np.asarray(self._file["x"][...], dtype=np.float32)
            if self._cache is None:
                uniq, inverse = np.unique(idx, return_inverse=True)
                data = self._read_rows(uniq)
        if self._cache is not None:
            return self._cache[idx], y
        return data[inverse.reshape(-1)], y

    def _read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Read sorted unique samples from the file (caller holds the lock).

        h5py's fancy indexing costs about 0.3 ms per index, so unfiltered one-sample chunks
        (what DatasetWriter makes) are read raw, and other layouts run by contiguous run.
        """
        assert self._file is not None
        x = self._file["x"]
        out = np.empty((rows.size, *self.meta.shape), dtype=np.float32)
        if self._raw_chunks:
            try:
                for k, i in enumerate(rows.tolist()):
                    mask, buf = x.id.read_direct_chunk((i, 0, 0, 0))
                    if mask:
                        raise OSError("chunk has filters applied")
                    out[k] = np.frombuffer(buf, dtype="<f4").reshape(self.meta.shape)
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
        idx = _as_index_array(indices, "indices")
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
        for x, _ in self.iter_blocks(np.arange(self.meta.num_samples), block):
            xh.update(_le_bytes(x))
        found = combine_fingerprint(
            xh.digest(), _digest(self._y), self._splits["train"], self._splits["test"]
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarise a dataset file as JSON-ready data.

    Args:
        path: the dataset file.

    Returns:
        ``{"path", "kind", "samples", "classes", "class_names", "shape", "fingerprint",
        "source", "counts": {"train", "test", "per_class": {"train": [...], "test": [...]}},
        "attrs"}``.

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
            "fingerprint": m.fingerprint,
            "source": m.source,
            "counts": {
                "train": m.train_count,
                "test": m.test_count,
                "per_class": {s: list(c) for s, c in m.class_counts.items()},
            },
            "attrs": dict(m.attrs),
        }
