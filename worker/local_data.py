"""Reads training samples from a local or shared copy of the dataset, one task ahead."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from types import TracebackType

import numpy as np

from common.dataset import DatasetReader
from common.errors import DatasetError

log = logging.getLogger(__name__)

# Files up to this size are loaded into memory on the first read; larger ones are read per task
# (one raw chunk per sample), so several workers on one host do not each hold a full copy.
DEFAULT_CACHE_BYTES = 256 << 20


class LocalData:
    """Reads ``(x, y)`` for index lists from a dataset file on its own thread.

    The same interface as ``worker.prefetch.Prefetcher``: ``start(indices)`` begins reading in
    the background; ``get(indices)`` returns the data, using the started read when it matches
    and reading now otherwise. The time ``get`` blocks is added to ``wait_s``.

    Args:
        reader: an open reader; ``close()`` closes it.
    """

    def __init__(self, reader: DatasetReader) -> None:
        self.reader = reader
        self.wait_s = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-data")
        self._pending: tuple[tuple[int, ...], concurrent.futures.Future] | None = None

    @property
    def fingerprint(self) -> str:
        """The fingerprint stored in the file."""
        return self.reader.meta.fingerprint

    def start(self, indices: list[int]) -> None:
        """Begin reading ``indices`` in the background (no-op for an empty list).

        Args:
            indices: dataset indices of the next task.
        """
        if len(indices):
            self._pending = (tuple(indices), self._pool.submit(self.reader.read, list(indices)))

    def get(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The samples for ``indices``, in order.

        Args:
            indices: dataset indices of the current task.

        Returns:
            ``(x, y)``: float32 (n, C, H, W) and int64 (n,).

        Raises:
            DatasetError: an index is out of range or the file cannot be read.
        """
        begin = time.perf_counter()
        key = tuple(indices)
        if self._pending is not None and self._pending[0] == key:
            future = self._pending[1]
        else:
            future = self._pool.submit(self.reader.read, list(indices))
        self._pending = None
        try:
            return future.result()
        finally:
            self.wait_s += time.perf_counter() - begin

    def close(self) -> None:
        """Stop the thread and close the file."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()

    def __enter__(self) -> LocalData:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _short(fingerprint: str) -> str:
    return f"{fingerprint[:12]}…" if len(fingerprint) > 12 else fingerprint


def open_local_copy(
    path: str | os.PathLike[str],
    expected_fingerprint: str,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    verify: bool = False,
) -> LocalData:
    """Open a copy of the server's dataset after checking it holds the same data and split.

    The check compares the fingerprint stored in the file with the server's (from the join
    reply). ``verify=True`` also recomputes the fingerprint from the file's contents, which
    reads the whole file once and catches a copy that was modified after it was written.

    Args:
        path: the local or shared copy of the dataset file.
        expected_fingerprint: the server's dataset fingerprint (``JoinReply.dataset_fingerprint``).
        cache_bytes: load the samples into memory if they take at most this many bytes.
        verify: recompute the fingerprint from the contents as well.

    Returns:
        A ``LocalData`` reading from ``path``.

    Raises:
        DatasetError: the file is missing or invalid, or its fingerprint differs from the
            server's.
    """
    reader = DatasetReader(path, cache_bytes=cache_bytes)
    try:
        found = reader.meta.fingerprint
        if found != expected_fingerprint:
            raise DatasetError(
                f"local copy {str(path)!r} has fingerprint {_short(found)}, the server's "
                f"dataset has {_short(expected_fingerprint)}; use the same file or drop --data"
            )
        if verify and not reader.verify():
            raise DatasetError(
                f"local copy {str(path)!r} does not match its own fingerprint {_short(found)} "
                "(modified after it was written); copy the server's file again or drop --data"
            )
    except BaseException:
        reader.close()
        raise
    log.info("reading samples from local copy %s (fingerprint %s)", path, _short(found))
    return LocalData(reader)
