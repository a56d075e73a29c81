"""A worker's heartbeat thread: proves liveness and notices a dead or restarted server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from common.errors import PSError
from common.protocol.client import Connection
from common.protocol.ending import RunEnded
from common.protocol.messages import HeartbeatReply, HeartbeatRequest

log = logging.getLogger(__name__)

# Heartbeats answered 'finished' before the worker gives up waiting for its own stop reply.
ENDED_BEATS = 3


class Heartbeat:
    """Sends a heartbeat every ``interval_s`` on its own socket and thread.

    When a heartbeat goes unanswered for ``dead_after_s``, is refused, or is answered by a
    different server (a restart), it publishes the reason on ``abort`` (an ``inproc://`` PUB
    endpoint), which ends every wait of the worker's connections with ``ServerLost``. When the
    server says training has ended for a few beats in a row (the worker is stuck on something
    that will never answer, such as a lost shard), it keeps that end in ``ended`` (a
    ``RunEnded``) before it publishes.

    Args:
        context: the worker's ZeroMQ context (inproc endpoints live in it).
        connect: makes a connection to the server with the given reply timeout.
        worker_id, token, server_id: the membership to keep alive.
        interval_s, dead_after_s: as told by the server at join.
        abort: the inproc endpoint to publish on.
    """

    def __init__(
        self,
        context: zmq.Context,
        connect: Callable[[float], Connection],
        *,
        worker_id: int,
        token: str,
        server_id: str,
        interval_s: float,
        dead_after_s: float,
        abort: str,
    ) -> None:
        self.connect = connect
        self.worker_id, self.token, self.server_id = worker_id, token, server_id
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self._publisher = context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self._publisher.bind(abort)
        self._stop = threading.Event()
        self.ended: RunEnded | None = None
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def _run(self) -> None:
        conn = self.connect(self.dead_after_s)
        reason = ""
        ended = 0
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    reply = conn.request(
                        HeartbeatRequest(worker_id=self.worker_id, token=self.token),
                        expect=HeartbeatReply,
                    )
                except PSError as exc:
                    reason = f"heartbeat failed: {exc}"
                    break
                if reply.server_id != self.server_id:
                    reason = "the server restarted"
                    break
                ended = 0 if reply.finish_reason is None else ended + 1
                if reply.finish_reason is not None and ended >= ENDED_BEATS:
                    self.ended = RunEnded(reply.finish_reason, reply.failure)
                    reason = str(self.ended)
                    break
        finally:
            conn.close()
        if reason and not self._stop.is_set():
            log.warning("%s", reason)
            self._publisher.send(reason.encode())

    def stop(self) -> None:
        """Stop beating and close the publisher (bounded by one heartbeat timeout)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.dead_after_s + 1)
        self._publisher.close(linger=0)
