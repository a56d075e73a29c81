"""Pulls training samples from the server on a background thread, one task ahead."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import zmq

from common.client import Connection
from common.messages import DataReply, DataRequest


class Prefetcher:
    """Fetches ``(x, y)`` for index lists over its own connection and thread.

    ``start(indices)`` begins fetching in the background; ``get(indices)`` returns the data,
    using the prefetched result when it matches and fetching now otherwise. The time ``get``
    blocks is added to ``wait_s``.

    Args:
        address: the server endpoint.
        worker_id: this worker's id.
        timeout_s: the wait for one data reply.
        context: the worker's ZeroMQ context.
        abort: inproc endpoint whose messages end a wait with ``ServerLost``.
    """

    def __init__(
        self,
        address: str,
        worker_id: int,
        timeout_s: float,
        context: zmq.Context | None = None,
        abort: str | None = None,
    ) -> None:
        self.address, self.worker_id, self.timeout_s = address, worker_id, timeout_s
        self.context, self.abort = context, abort
        self.wait_s = 0.0
        self._local = threading.local()
        self._connections: list[Connection] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._pending: tuple[tuple[int, ...], concurrent.futures.Future] | None = None

    def _fetch(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = Connection(
                self.address, self.timeout_s, context=self.context, abort=self.abort
            )
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
