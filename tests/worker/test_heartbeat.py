"""A worker's heartbeat thread: heartbeats that say the run ended end the worker's wait, and
the end they told is kept as a ``RunEnded``."""

from __future__ import annotations

import threading

import pytest
import zmq

from common.errors import ServerLost
from common.protocol.client import Connection
from common.protocol.ending import FinishReason
from common.protocol.messages import HeartbeatReply, StatusReply, StatusRequest
from common.protocol.wire import decode_frames
from worker.heartbeat import Heartbeat


def test_heartbeats_that_say_a_failure_ended_the_run_end_a_wait_with_that_end() -> None:
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    done = threading.Event()
    beats: list[int] = []

    def answer_heartbeats_only() -> None:  # a status request stays unanswered
        while not done.is_set():
            if not server.poll(50):
                continue
            identity, *frames = server.recv_multipart()
            header, _ = decode_frames(frames)
            if header["type"] == "heartbeat_request":
                beats.append(header["id"])
                reply = HeartbeatReply(
                    server_id="s1", finish_reason=FinishReason.FAILED, failure="shard 1 lost"
                )
                server.send_multipart([identity, *reply.to_wire(header["id"])])

    thread = threading.Thread(target=answer_heartbeats_only, daemon=True)
    thread.start()
    abort = "inproc://abort-heartbeat-test"
    heartbeat = Heartbeat(
        context,
        lambda t: Connection(address, t, context=context),
        worker_id=1,
        token="tok",
        server_id="s1",
        interval_s=0.2,
        dead_after_s=5.0,
        abort=abort,
    )
    waiting = Connection(address, 30.0, context=context, abort=abort)
    try:
        heartbeat.start()
        with pytest.raises(ServerLost, match="the server stopped the run: shard 1 lost"):
            waiting.request(StatusRequest(), expect=StatusReply)
        ended = heartbeat.ended
        assert ended is not None and len(beats) >= 3  # a few beats in a row, not the first
        assert (ended.reason, ended.failure) == (FinishReason.FAILED, "shard 1 lost")
    finally:
        heartbeat.stop()
        done.set()
        thread.join(timeout=5)
        waiting.close()
        server.close(linger=0)
        context.term()
