"""Samples pulled from the server: a data reply that does not fit the request is refused with
a protocol error naming what is wrong, before any sample reaches training."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from common.data.codec import SampleCodec
from common.errors import ProtocolError
from common.protocol.client import Connection
from common.protocol.messages import DataReply
from common.protocol.wire import decode_frames
from worker.prefetch import Prefetcher

pytestmark = pytest.mark.unit

SHAPE = (3, 5, 5)
CLASSES = 4


@pytest.fixture
def serve() -> Iterator[tuple[zmq.Context, str, list[DataReply]]]:
    """A ROUTER on 127.0.0.1 that answers each request with the next queued data reply."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    replies: list[DataReply] = []
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            if server.poll(50):
                identity, *frames = server.recv_multipart()
                header, _ = decode_frames(frames)
                server.send_multipart([identity, *replies.pop(0).to_wire(header["id"])])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield context, address, replies
    finally:
        done.set()
        thread.join(timeout=5)
        server.close(linger=0)
        context.term()


def pull(serve: tuple[zmq.Context, str, list[DataReply]], reply: DataReply) -> tuple:
    context, address, replies = serve
    replies.append(reply)
    prefetcher = Prefetcher(
        lambda: Connection(address, 5.0, context=context),
        1,
        token="tok",
        codec=SampleCodec("float32"),
        shape=SHAPE,
        num_classes=CLASSES,
    )
    try:
        return prefetcher.get([0, 1])
    finally:
        prefetcher.close()


def samples(n: int = 2) -> np.ndarray:
    return np.zeros((n, *SHAPE), np.float32)


def test_a_fitting_reply_becomes_the_batch(serve) -> None:
    x, y = pull(serve, DataReply(x=samples(), y=np.array([0, CLASSES - 1], np.int64)))
    assert tuple(x.shape) == (2, *SHAPE) and y.tolist() == [0, CLASSES - 1]


@pytest.mark.parametrize(
    ("x", "y", "named"),
    [
        (
            samples(),
            np.array([0, CLASSES], np.int64),
            rf"in \[0, {CLASSES}\), got int64 0..{CLASSES}",
        ),
        (samples(), np.array([-1, 0], np.int64), r"got int64 -1..0"),
        (samples(), np.array([0.0, 1.0], np.float32), r"got float32"),
        (samples(), np.array([0, 1, 2], np.int64), r"2 samples and \(3,\) labels"),
        (samples(3), np.array([0, 1, 2], np.int64), r"3 samples"),
        (np.zeros((2, 3, 4, 4), np.float32), np.array([0, 1], np.int64), r"samples must be"),
    ],
)
def test_a_reply_that_does_not_fit_is_refused(serve, x, y, named) -> None:
    with pytest.raises(ProtocolError, match=named):
        pull(serve, DataReply(x=x, y=y))
