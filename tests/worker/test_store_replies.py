"""The worker's store client against a store that answers pulls with what was not asked: a
reply of another type, of another range or size, or parameters older than asked, is a
protocol error raised once every answer is read, and never leaves part of the state unloaded
or loaded from the wrong version."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import zmq

from common.errors import ProtocolError
from common.protocol.base import Message, parse_message
from common.protocol.chunks import ALIGN
from common.protocol.messages import JoinReply, LeaveReply, ParamsChunk, PullRequest
from worker.params import StoreClient

CHUNK, CHUNKS = ALIGN, 3
Answer = Callable[[PullRequest], Message]


def _join(address: str) -> JoinReply:
    return JoinReply(
        worker_id=1,
        token="t",
        store_token="s",
        mode="async",
        model="hsi-cnn",
        in_channels=1,
        num_classes=2,
        input_size=1,
        state_size=CHUNK * CHUNKS,
        num_params=CHUNK * CHUNKS,
        dataset_fingerprint="f",
        seed=0,
        server_id="x",
        heartbeat_s=1.0,
        dead_after_s=5.0,
        wire_dtype="fp32",
        chunk_elems=CHUNK,
        shard_addresses=[address],
        shard_bounds=[0, CHUNK * CHUNKS],
        sample_dtype="float32",
        norm_mean=[],
        norm_std=[],
    )


def _chunk(pull: PullRequest, version: int) -> ParamsChunk:
    params = np.full(pull.length, 7.0, dtype=np.float32)
    return ParamsChunk(version=version, offset=pull.offset, scale=1.0, params=params)


@pytest.fixture
def store() -> Iterator[tuple[zmq.Context, str, list[Answer]]]:
    """A ROUTER socket on a thread answering each pull with the next of ``answers``."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    answers: list[Answer] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(100):
                continue
            identity, *frames = router.recv_multipart()
            pull, request_id = parse_message(frames, {PullRequest.TYPE: PullRequest})
            assert isinstance(pull, PullRequest)
            router.send_multipart([identity, *answers.pop(0)(pull).to_wire(request_id)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield context, f"tcp://127.0.0.1:{port}", answers
    finally:
        stop.set()
        thread.join(10)
        router.close(linger=0)
        context.term()


@pytest.mark.parametrize(
    ("wrong", "why"),
    [
        pytest.param(lambda pull: LeaveReply(), "a store answered", id="another-reply-type"),
        pytest.param(lambda pull: _chunk(pull, 2), "a store answered", id="older-than-asked"),
        pytest.param(
            lambda pull: dataclasses.replace(_chunk(pull, 5), offset=0), "asked", id="another-range"
        ),
        pytest.param(
            lambda pull: dataclasses.replace(_chunk(pull, 5), params=np.ones(1, np.float32)),
            "wrong size",
            id="another-size",
        ),
    ],
)
def test_a_pull_answered_with_what_was_not_asked_is_a_protocol_error(
    store: tuple[zmq.Context, str, list[Answer]], wrong: Answer, why: str
) -> None:
    context, address, answers = store
    answers.extend([lambda pull: _chunk(pull, 5), wrong, lambda pull: _chunk(pull, 5)])
    client = StoreClient(context, _join(address), coordinator=address)
    state = torch.zeros(CHUNK * CHUNKS)
    try:
        client.pull(5)
        with pytest.raises(ProtocolError, match=why):
            client.collect(state, timeout_s=20)
    finally:
        client.close()
    # every answer was drained: the good chunks are in, the wrong one never was
    assert torch.equal(state[CHUNK : 2 * CHUNK], torch.zeros(CHUNK))
    assert torch.equal(state[:CHUNK], torch.full((CHUNK,), 7.0))
    assert torch.equal(state[2 * CHUNK :], torch.full((CHUNK,), 7.0))


def test_a_pull_answered_as_asked_loads_every_chunk(
    store: tuple[zmq.Context, str, list[Answer]],
) -> None:
    context, address, answers = store
    answers.extend(lambda pull: _chunk(pull, 6) for _ in range(CHUNKS))
    client = StoreClient(context, _join(address), coordinator=address)
    state = torch.zeros(CHUNK * CHUNKS)
    try:
        client.pull(5)
        assert client.collect(state, timeout_s=20) == 6
    finally:
        client.close()
    assert torch.equal(state, torch.full((CHUNK * CHUNKS,), 7.0))


@pytest.mark.parametrize("bounds", [[0, CHUNK], [CHUNK, CHUNK * CHUNKS], [0, CHUNK * CHUNKS + 1]])
def test_shard_bounds_that_do_not_cover_the_state_are_refused(bounds: list[int]) -> None:
    """Bounds that leave part of the state to no store would leave it never pulled."""
    context = zmq.Context()
    try:
        join = dataclasses.replace(_join("tcp://127.0.0.1:9"), shard_bounds=bounds)
        with pytest.raises(ProtocolError, match="do not cover the state"):
            StoreClient(context, join, coordinator="tcp://127.0.0.1:9").close()
    finally:
        context.term()
