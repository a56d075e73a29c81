"""Writing the HDF5 dataset format in one streaming pass."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from tqdm import tqdm

from common.data.codec import RAW_DTYPES, STORED_DTYPES, SampleCodec, encode
from common.data.dataset import FORMAT_VERSION, KINDS, DatasetMeta, DatasetReader
from common.data.fingerprint import as_index_array, combine_fingerprint, le_bytes
from common.errors import DatasetError

log = logging.getLogger(__name__)

BLOCK_BYTES = 32 << 20  # bytes of float32 samples held per write; bounds conversion memory


def _check_split(idx: np.ndarray, n: int, name: str) -> np.ndarray:
    """Sort a split's indices and check range and uniqueness."""
    idx = np.sort(as_index_array(idx, name))
    if idx.size and (idx[0] < 0 or idx[-1] >= n):
        bad = idx[0] if idx[0] < 0 else idx[-1]
        raise DatasetError(f"{name} contains index {int(bad)} outside [0, {n})")
    if idx.size > 1 and np.any(idx[1:] == idx[:-1]):
        dup = idx[1:][idx[1:] == idx[:-1]][0]
        raise DatasetError(f"{name} contains index {int(dup)} more than once")
    return idx


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
        *,
        num_samples: int,
        kind: str,
        class_names: Sequence[str],
        source: str = "",
        x_dtype: str = "float32",
    ) -> None:
        """Create the temporary file and its datasets.

        Args:
            path: where the finished file goes (any existing file is replaced at ``close``).
            shape: the shape (C, H, W) of one sample.
            num_samples: how many samples ``write`` will receive in total.
            kind: ``"hsi"`` or ``"scenes"``.
            class_names: one name per class; labels are 0..len(class_names)-1.
            source: free text saying where the data came from.
            x_dtype: how ``/x`` is stored: ``float32`` or ``float16`` (normalised samples), or
                ``uint8``/``uint16``/``int16`` (raw sensor values, normalised on read with the
                statistics ``close`` is given).

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
        if x_dtype not in STORED_DTYPES:
            raise DatasetError(f"x_dtype {x_dtype!r} is not one of {STORED_DTYPES}")
        self.x_dtype = x_dtype
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
                "x",
                shape=(self.num_samples, *self.shape),
                dtype=np.dtype(x_dtype).newbyteorder("<"),
                chunks=(1, *self.shape),
            )
            self._y = self._file.create_dataset("y", shape=(self.num_samples,), dtype="<i8")
        except Exception as exc:
            self.abort()
            raise DatasetError(
                f"cannot create dataset file next to {str(self.path)!r}: {exc}"
            ) from exc

    def write(self, x_block: np.ndarray, y_block: np.ndarray) -> None:
        """Append a block of samples after those already written.

        Args:
            x_block: array (n, C, H, W), stored as ``x_dtype`` (values must fit it).
            y_block: integer labels (n,) in [0, num_classes).

        Raises:
            DatasetError: the writer is closed, shapes or labels are wrong, values are not
                finite, or the block would exceed ``num_samples``.
        """
        if self._file is None:
            raise DatasetError(f"writer for {str(self.path)!r} is already closed")
        x = np.asarray(x_block)
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
        x = encode(x, self.x_dtype)
        start = self._written
        self._x[start : start + n] = x
        self._y[start : start + n] = y
        self._x_hash.update(le_bytes(x))
        self._y_hash.update(le_bytes(y))
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
            norm_mean: per-band mean (C,) subtracted from the raw data, stored as
                ``/norm_mean`` (required for raw ``x_dtype``: the reader subtracts it).
            norm_std: per-band std (C,) the centred data is divided by, ``/norm_std``.
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
            raw = self.x_dtype in RAW_DTYPES
            if raw:  # the reader will normalise: the statistics must be usable
                if norm_mean is None or norm_std is None:
                    raise DatasetError(f"raw {self.x_dtype} samples need norm_mean and norm_std")
                SampleCodec(self.x_dtype, np.asarray(norm_mean), np.asarray(norm_std))
            f = self._file
            f.attrs["normalise_on_read"] = int(raw)
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

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._file is None:
            return
        self.abort()
        if exc_type is None:
            raise DatasetError(f"writer for {str(self.path)!r} left without close(); file removed")


def write_scenes(
    out: str | os.PathLike[str],
    read: Callable[[int], tuple[np.ndarray, int]],
    count: int,
    split: Callable[[np.ndarray], tuple[Sequence[str], np.ndarray, np.ndarray]],
    *,
    source: str,
    progress: bool = False,
    extra_attrs: dict[str, Any] | None = None,
    extra_datasets: dict[str, np.ndarray] | None = None,
    block: int | None = None,
) -> DatasetMeta:
    """Stream ``count`` images into a scenes dataset file in two passes.

    The first pass reads every image and keeps its per-band mean and sum of squared
    deviations; ``split`` then names the classes and splits the samples. The second pass reads
    every image again, checks that it is the one read before, normalises it with the training
    images' per-band mean and std and writes blocks of ``block`` images (default: about
    ``BLOCK_BYTES``).

    Args:
        out: the dataset file to write.
        read: image ``i`` as float32 (C, H, W), every one of one shape, and its label.
        count: how many images there are.
        split: ``(class names, train indices, test indices)`` for the labels read.
        source: free text stored in the file.
        progress: show a progress bar per pass on stderr.
        extra_attrs: more root attributes.
        extra_datasets: more root datasets.
        block: images per write.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: an image differs between the two passes, or ``read``, ``split`` or the
            writer refuse the data.
    """
    labels = np.zeros(count, dtype=np.int64)
    means = m2s = np.zeros(0)
    for i in tqdm(range(count), desc="pass 1/2 (check)", unit="image", disable=not progress):
        image, labels[i] = read(i)
        if i == 0:
            means, m2s = np.zeros((count, image.shape[0])), np.zeros((count, image.shape[0]))
        pixels = image.reshape(image.shape[0], -1).astype(np.float64)
        means[i] = pixels.mean(axis=1)
        m2s[i] = ((pixels - means[i][:, None]) ** 2).sum(axis=1)
    shape = image.shape
    names, train, test = split(labels)
    mean = means[train].mean(axis=0)
    m2 = m2s[train].sum(axis=0) + shape[1] * shape[2] * ((means[train] - mean) ** 2).sum(axis=0)
    std = np.sqrt(m2 / (shape[1] * shape[2] * train.size))
    std[std < 1e-12] = 1.0
    mean32, std32 = mean.astype(np.float32)[:, None, None], std.astype(np.float32)[:, None, None]
    if shape[1] != shape[2]:
        log.warning("images are %s, not square; models get input_size=%d", shape, shape[1])
    block = block or max(1, BLOCK_BYTES // (4 * int(np.prod(shape))))
    log.info("pass 2: writing %s in blocks of %d images", out, block)
    writer = DatasetWriter(
        out, shape, num_samples=count, kind="scenes", class_names=names, source=source
    )
    with writer:
        buf = np.empty((block, *shape), dtype=np.float32)
        filled = 0
        for i in tqdm(range(count), desc="pass 2/2 (write)", unit="image", disable=not progress):
            image, label = read(i)
            again = image.reshape(shape[0], -1).astype(np.float64).mean(axis=1)
            if label != labels[i] or not np.allclose(again, means[i], rtol=1e-6, atol=1e-9):
                raise DatasetError(
                    f"sample {i} differs between two reads (random transforms?); the dataset "
                    "must return the same sample for the same index"
                )
            np.subtract(image, mean32, out=buf[filled])
            buf[filled] /= std32
            filled += 1
            if filled == block or i == count - 1:
                writer.write(buf[:filled], labels[i + 1 - filled : i + 1])
                filled = 0
        writer.close(train, test, extra_attrs, mean, std, extra_datasets)
    with DatasetReader(out, cache_bytes=0) as reader:
        return reader.meta
