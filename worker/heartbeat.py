"""A worker's heartbeat thread: proves liveness and notices a dead or restarted server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from common.errors import PSError
from common.protocol.client import Connection
from common.protocol.messages import HeartbeatReply, HeartbeatRequest

log = logging.getLogger(__name__)

TRAINING_ENDED = "training has ended"
RUN_FAILED = "the server stopped the run: "  # followed by the failure
# Heartbeats answered 'finished' before the worker gives up waiting for its own stop reply.
ENDED_BEATS = 3


class Heartbeat:
    """Sends a heartbeat every ``interval_s`` on its own socket and thread.

    When a heartbeat goes unanswered for ``dead_after_s``, is refused, or is answered by a
    different server (a restart), it publishes the reason on ``abort`` (an ``inproc://`` PUB
    endpoint), which ends every wait of the worker's connections with ``ServerLost``. When the
    server says training has ended for a few beats in a row (the worker is stuck on something
    that will never answer, such as a lost shard), it publishes ``TRAINING_ENDED``, or
    ``RUN_FAILED`` and the failure when one ended the run; ``finish_reason`` then holds why
    training ended, when the server says.

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
        self.finish_reason: str | None = None
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
                ended = ended + 1 if reply.finished else 0
                if reply.finished:
                    self.finish_reason = reply.finish_reason or self.finish_reason
                if ended >= ENDED_BEATS:
                    reason = RUN_FAILED + reply.failure if reply.failure else TRAINING_ENDED
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
