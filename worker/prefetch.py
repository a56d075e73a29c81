"""Pulls training samples from the server on a background thread, one task ahead."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import numpy as np

from common.client import Connection
from common.messages import DataReply, DataRequest


class Prefetcher:
    """Fetches ``(x, y)`` for index lists over its own connection and thread.

    ``start(indices)`` begins fetching in the background; ``get(indices)`` returns the data,
    using the prefetched result when it matches and fetching now otherwise. The time ``get``
    blocks is added to ``wait_s``.

    Args:
        connect: makes a new connection to the server (called on the prefetch thread).
        worker_id: this worker's id.
    """

    def __init__(self, connect: Callable[[], Connection], worker_id: int) -> None:
        self.connect, self.worker_id = connect, worker_id
        self.wait_s = 0.0
        self._local = threading.local()
        self._connections: list[Connection] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._pending: tuple[tuple[int, ...], concurrent.futures.Future] | None = None

    def _fetch(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
            self._connections.append(conn)
        reply = conn.request(DataRequest(worker_id=self.worker_id, indices=indices))
        assert isinstance(reply, DataReply)
        return reply.x, reply.y

    def start(self, indices: list[int]) -> None:
        """Begin fetching ``indices`` in the background (no-op for an empty list)."""
        if indices:
            self._pending = (tuple(indices), self._pool.submit(self._fetch, list(indices)))

    def get(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The samples for ``indices``, in order.

        Raises:
            NetworkTimeout, RemoteError: the server did not deliver them.
        """
        begin = time.perf_counter()
        key = tuple(indices)
        if self._pending is not None and self._pending[0] == key:
            future = self._pending[1]
        else:
            future = self._pool.submit(self._fetch, list(indices))
        self._pending = None
        try:
            return future.result()
        finally:
            self.wait_s += time.perf_counter() - begin

    def close(self) -> None:
        """Stop the thread and close its connection."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for conn in self._connections:
            conn.close()
