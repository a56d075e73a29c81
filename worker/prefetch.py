"""Pulls training samples from the server on a background thread, one task ahead, and keeps
the samples it got (up to a byte budget) so later epochs need no data request for them."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from common.data.codec import SampleCodec
from common.errors import DatasetError, ErrorCode, ProtocolError
from common.protocol.client import Connection
from common.protocol.messages import DataReply, DataRequest, JoinReply
from worker.sample_cache import SampleCache

_Batch = tuple[torch.Tensor, torch.Tensor, bool]  # x, y, every sample was kept


class AheadReader:
    """Reads ``(x, y)`` for index lists on its own thread, one task ahead.

    ``start(indices)`` begins reading in the background; ``get(indices)`` returns the batch,
    using the started read when it matches and reading now otherwise. The time ``get`` blocks
    is added to ``wait_s``. All else runs on the thread (finding the kept samples, the read,
    the gather, the tensors): the training loop gets a finished batch.

    With ``cache_bytes``, samples read are kept (the first ones until the budget is full, none
    evicted) and only the samples not kept are read: once every sample of a task is kept, the
    task needs no read. The dataset does not change during a run, so a kept sample equals a
    fresh read.

    Args:
        thread_name: name prefix of the reading thread.
        fetch: reads the samples of an index list (called on the reading thread).
        close: releases the source once the thread has stopped.
        cache_bytes: how many bytes of samples to keep (0: none).
    """

    def __init__(
        self,
        thread_name: str,
        fetch: Callable[[list[int]], tuple[np.ndarray, np.ndarray]],
        *,
        close: Callable[[], None],
        cache_bytes: int = 0,
    ) -> None:
        self._fetch, self._close_source = fetch, close
        self.wait_s = 0.0
        self.cache_hits = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._pending: tuple[tuple[int, ...], concurrent.futures.Future[_Batch]] | None = None
        self._cache = SampleCache(cache_bytes)

    def start(self, indices: list[int]) -> None:
        """Begin making the batch of ``indices`` in the background."""
        if indices:
            self._pending = (tuple(indices), self._pool.submit(self._batch, indices))

    def get(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples for ``indices``, in order: float32 (n, C, H, W) and int64 (n,).

        Raises:
            NetworkTimeout, RemoteError, DatasetError: the source did not deliver them.
        """
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != tuple(indices):
            # after the started read (one thread): what it keeps is not read again
            future = self._pool.submit(self._batch, indices)
        else:
            future = pending[1]
        begin = time.perf_counter()
        try:
            x, y, kept = future.result()
        finally:
            self.wait_s += time.perf_counter() - begin
        self.cache_hits += kept
        return x, y

    def _batch(self, indices: list[int]) -> _Batch:
        """The batch of ``indices`` as tensors and whether every sample was kept (on the
        reading thread, the only one that touches the kept samples)."""
        missing = self._cache.missing(indices)
        kept = bool(indices) and not missing
        if kept:
            x, y = self._cache.batch(indices)
        else:
            x, y = self._cache.merge(indices, missing, *self._read(missing))
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y), kept

    def _read(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Read the samples and keep them."""
        return self._cache.add(indices, *self._fetch(indices))

    def close(self) -> None:
        """Stop the thread, then close the source."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._close_source()


class Prefetcher(AheadReader):
    """Pulls samples from the server over its own connection.

    Samples arrive in their stored dtype and are normalised here, on the worker.

    Args:
        connect: makes a new connection to the server (called on the reading thread).
        worker_id, token: this worker's membership.
        codec: the stored dtype and normalisation the join reply announced.
        shape: one sample's (C, H, W).
        num_classes: labels are in ``[0, num_classes)``.
        cache_bytes: how many bytes of samples to keep for later epochs.
    """

    def __init__(
        self,
        connect: Callable[[], Connection],
        worker_id: int,
        *,
        token: str,
        codec: SampleCodec,
        shape: tuple[int, int, int],
        num_classes: int,
        cache_bytes: int = 0,
    ) -> None:
        super().__init__(
            "prefetch", self._pull, close=self._close_connections, cache_bytes=cache_bytes
        )
        self.connect, self.worker_id, self.token = connect, worker_id, token
        self.codec, self.shape, self.num_classes = codec, shape, num_classes
        self._local = threading.local()
        self._connections: list[Connection] = []

    def _pull(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
            self._connections.append(conn)
        reply = conn.request(
            DataRequest(worker_id=self.worker_id, token=self.token, indices=indices),
            expect=DataReply,
        )
        try:
            self.codec.check_stored(reply.x, self.shape)
        except DatasetError as exc:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"data_reply: {exc}") from exc
        if len(reply.x) != len(indices) or reply.y.shape != (len(indices),):
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"data_reply has {len(reply.x)} samples and {reply.y.shape} labels "
                f"for {len(indices)} indices",
            )
        y = reply.y
        if y.dtype != np.int64 or (y.size and (y.min() < 0 or y.max() >= self.num_classes)):
            got = f"{y.dtype} {y.min()}..{y.max()}" if y.size else str(y.dtype)
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"data_reply labels must be int64 in [0, {self.num_classes}), got {got}",
            )
        return self.codec.decode(reply.x), y

    def _close_connections(self) -> None:
        for conn in self._connections:
            conn.close()


def sample_codec(spec: JoinReply) -> SampleCodec:
    """How the server's samples become model input, from its join reply.

    Raises:
        ProtocolError: the reply names no usable dtype or statistics.
    """
    mean = np.asarray(spec.norm_mean, dtype=np.float32) if spec.norm_mean else None
    std = np.asarray(spec.norm_std, dtype=np.float32) if spec.norm_std else None
    try:
        codec = SampleCodec(spec.sample_dtype, mean, std)
    except DatasetError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"join_reply: {exc}") from exc
    if mean is not None and mean.shape != (spec.in_channels,):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"join_reply: {mean.size} band statistics for {spec.in_channels}"
        )
    return codec
