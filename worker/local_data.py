"""Reads training samples from a local or shared copy of the dataset, one task ahead."""

from __future__ import annotations

import logging
import os

from common.data.dataset import DatasetReader
from common.errors import DatasetError
from worker.prefetch import AheadReader

log = logging.getLogger(__name__)

# Files up to this size are loaded into memory on the first read; larger ones are read per task
# (one raw chunk per sample), so several workers on one host do not each hold a full copy.
DEFAULT_CACHE_BYTES = 256 << 20


def _short(fingerprint: str) -> str:
    return f"{fingerprint[:12]}…" if len(fingerprint) > 12 else fingerprint


def open_local_copy(
    path: str | os.PathLike[str],
    expected_fingerprint: str,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    verify: bool = False,
) -> AheadReader:
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
        An ``AheadReader`` reading from ``path`` (``worker join --data``).

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
    return AheadReader("local-data", reader.read, close=reader.close)
