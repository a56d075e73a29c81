"""The coordinator's and shards' ROUTER endpoint on a real socket: every request is answered,
malformed frames and failing handlers with error replies, slow handlers hold up nobody, and
the tasks it owns end when cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from common.errors import ConfigError, ErrorCode, ProtocolError, RemoteError
from common.protocol.base import Message, error_frames
from common.protocol.messages import (
    REPLIES,
    DataReply,
    StatusReply,
    StatusRequest,
    parse_message,
)
from common.protocol.security import load_client_keys
from common.protocol.wire import PROTOCOL_VERSION
from pserver.store.pool import BufferPool
from pserver.transport import COPY_BELOW, TRACK_ABOVE, Endpoint, Request, TaskOwner
from tests.support.live import poll_until_async

REPLY_TIMEOUT_S = 10.0
Handler = Callable[[Endpoint, Request, Message], Awaitable[None]]


class Served:
    """An endpoint serving ``handler`` on 127.0.0.1 and one DEALER client talking to it."""

    def __init__(self, endpoint: Endpoint, client: zmq.asyncio.Socket) -> None:
        self.endpoint, self.client = endpoint, client

    async def send(self, frames: list[bytes]) -> None:
        await self.client.send_multipart(frames)

    async def reply(self) -> tuple[Message, int]:
        """The next reply, parsed (raises RemoteError for an error reply)."""
        frames = await asyncio.wait_for(self.client.recv_multipart(), REPLY_TIMEOUT_S)
        return parse_message(frames, REPLIES)

    async def error(self) -> RemoteError:
        """The next reply, which must be an error reply."""
        with pytest.raises(RemoteError) as caught:
            await self.reply()
        return caught.value


async def answer_status(endpoint: Endpoint, request: Request, message: Message) -> None:
    """Answer a status request with the request id it carried."""
    reply = StatusReply(status={"asked": request.request_id})
    endpoint.reply(request.identity, request.request_id, reply)


@contextlib.asynccontextmanager
async def serving(handler: Handler, keys: dict[str, Path] | None = None) -> AsyncIterator[Served]:
    """``handler`` served, over CURVE with the worker's key pair when ``keys`` are given."""
    owner = TaskOwner()
    endpoint = Endpoint(
        "tcp://127.0.0.1:0",
        {StatusRequest.TYPE: StatusRequest},
        max_message_bytes=1 << 20,
        owner=owner,
        curve_secret=keys["server_secret"] if keys else None,
        authorized_keys=keys["authorized_keys"] if keys else None,
    )
    address = endpoint.bind()
    loop = owner.spawn(
        endpoint.receive_loop(lambda request, message: handler(endpoint, request, message))
    )
    client = endpoint.context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    if keys:
        load_client_keys(keys["server"], keys["worker_secret"]).apply(client)
    client.connect(address)
    try:
        yield Served(endpoint, client)
    finally:
        client.close(linger=0)
        await owner.cancel_all()
        assert loop.cancelled()
        endpoint.close()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serving(answer_status) as it:
        yield it


@contextlib.asynccontextmanager
async def spoken_to() -> AsyncIterator[tuple[Served, bytes]]:
    """An endpoint that answers nothing, and its client's identity once the client spoke."""
    identities: list[bytes] = []

    async def remember(endpoint: Endpoint, request: Request, message: Message) -> None:
        identities.append(request.identity)

    async with serving(remember) as served:
        await served.send(StatusRequest().to_wire(1))
        await poll_until_async(lambda: bool(identities), REPLY_TIMEOUT_S, what="a peer")
        yield served, identities[0]


def raw_header(**fields: object) -> bytes:
    header = {"v": PROTOCOL_VERSION, "type": "status_request", "id": 7, "body": {}, "tensors": []}
    header.update(fields)
    return msgpack.packb(header)


async def test_each_request_is_answered_under_its_own_id(served: Served) -> None:
    for request_id in (1, 2, 99):
        await served.send(StatusRequest().to_wire(request_id))
    replies = [await served.reply() for _ in range(3)]
    assert [(r.status["asked"], rid) for r, rid in replies] == [(1, 1), (2, 2), (99, 99)]


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\x00\xffnot msgpack"], ErrorCode.BAD_FRAME),
        ([raw_header(v=PROTOCOL_VERSION + 1)], ErrorCode.BAD_VERSION),
        ([raw_header(type="drop_tables")], ErrorCode.UNKNOWN_TYPE),
        ([raw_header(type="join_request")], ErrorCode.UNKNOWN_TYPE),  # not this endpoint's
        (error_frames(7, ErrorCode.STALE, "a reply sent as a request"), ErrorCode.BAD_FIELD),
    ],
    ids=["garbage", "other-version", "unknown-type", "type-served-elsewhere", "error-reply"],
)
async def test_malformed_frames_get_an_error_and_the_next_request_its_answer(
    served: Served, frames: list[bytes], code: ErrorCode
) -> None:
    await served.send(frames)
    assert (await served.error()).code == code
    await served.send(StatusRequest().to_wire(8))
    reply, request_id = await served.reply()
    assert request_id == 8 and reply.status == {"asked": 8}


async def test_handler_failures_become_error_replies(caplog: pytest.LogCaptureFixture) -> None:
    async def failing(endpoint: Endpoint, request: Request, message: Message) -> None:
        if request.request_id == 1:
            raise ProtocolError(ErrorCode.STALE, "computed on version 3, now 9")
        raise RuntimeError("the handler broke")

    async with serving(failing) as served:
        await served.send(StatusRequest().to_wire(1))
        refused = await served.error()
        assert (refused.code, refused.request_id) == (ErrorCode.STALE, 1)
        assert "computed on version 3, now 9" in str(refused)
        with caplog.at_level(logging.ERROR, logger="pserver.transport"):
            await served.send(StatusRequest().to_wire(2))
            broke = await served.error()
        assert (broke.code, broke.request_id) == (ErrorCode.INTERNAL, 2)
        assert "RuntimeError: the handler broke" in str(broke)
        assert any("failed to handle status_request" in r.message for r in caplog.records)


async def test_a_slow_handler_holds_up_no_other_request() -> None:
    second_answered = asyncio.Event()

    async def first_waits(endpoint: Endpoint, request: Request, message: Message) -> None:
        if request.request_id == 1:
            await asyncio.wait_for(second_answered.wait(), REPLY_TIMEOUT_S)
        await answer_status(endpoint, request, message)
        if request.request_id == 2:
            second_answered.set()

    async with serving(first_waits) as served:
        await served.send(StatusRequest().to_wire(1))
        await served.send(StatusRequest().to_wire(2))
        order = [(await served.reply())[1] for _ in range(2)]
        assert order == [2, 1]


async def test_binding_a_taken_address_is_a_config_error_naming_it(served: Served) -> None:
    taken = served.endpoint.address
    other = Endpoint(
        taken, {StatusRequest.TYPE: StatusRequest}, max_message_bytes=1 << 20, owner=TaskOwner()
    )
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on {taken}"):
            other.bind()
    finally:
        other.close()


async def test_large_replies_count_in_flight_until_handed_to_the_network() -> None:
    async with spoken_to() as (served, peer):
        endpoint = served.endpoint
        small = DataReply(x=np.zeros((4, 4), np.float32), y=np.zeros(4, np.int64))
        endpoint.reply(peer, 1, small)
        assert endpoint.in_flight(peer) == 0  # small replies are not counted
        big = DataReply(x=np.ones((256, 256), np.float32), y=np.zeros(256, np.int64))
        endpoint.reply(peer, 2, big)
        assert endpoint.in_flight(peer) >= big.x.nbytes + big.y.nbytes
        first, second = await served.reply(), await served.reply()
        assert (first[1], second[1]) == (1, 2)
        assert np.array_equal(second[0].x, big.x)
        await poll_until_async(
            lambda: endpoint.in_flight(peer) == 0, REPLY_TIMEOUT_S, what="no replies in flight"
        )


@pytest.mark.parametrize("values", [COPY_BELOW // 8, COPY_BELOW // 2])
async def test_a_leased_reply_holds_its_buffer_until_sent_and_arrives_as_it_was(
    values: int,
) -> None:
    """Below ``COPY_BELOW`` bytes the frames are copied, so the buffer is free once the send
    is queued; above, ZeroMQ reads the buffer itself until the frames left. Either way the
    buffer is reused only when free, and what arrives is what was sent."""
    async with spoken_to() as (served, peer):
        pool = BufferPool(values)
        buffer, lease = pool.acquire()
        buffer.fill_(3.0)
        sent = buffer.numpy()
        served.endpoint.reply(peer, 2, DataReply(x=sent, y=np.zeros(1, np.int64)), lease)
        lease.release()  # the owner lets go; the reply still holds it
        await poll_until_async(lease.free, REPLY_TIMEOUT_S, what="the buffer let go")
        buffer.fill_(-1.0)  # reused
        reply, request_id = await served.reply()
        assert request_id == 2 and bool((reply.x == 3.0).all())


@pytest.mark.parametrize("curve", [True, False])
async def test_under_curve_every_request_carries_the_key_it_came_with(
    curve: bool, curve_keys
) -> None:
    """The sender's public key (z85) is read from each request under CURVE (members are bound
    to it); in clear there is none."""
    seen: list[str] = []

    async def remember(endpoint: Endpoint, request: Request, message: Message) -> None:
        seen.append(request.user_id)
        await answer_status(endpoint, request, message)

    async with serving(remember, curve_keys if curve else None) as served:
        for request_id in (1, 2):
            await served.send(StatusRequest().to_wire(request_id))
            await served.reply()
    public = load_client_keys(curve_keys["server"], curve_keys["worker_secret"]).public
    assert seen == [public.decode() if curve else ""] * 2


async def test_the_owner_logs_failures_and_cancels_what_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = TaskOwner()
    forever = owner.spawn(asyncio.Event().wait())

    async def fail() -> None:
        raise ValueError("background work broke")

    with caplog.at_level(logging.ERROR, logger="pserver.transport"):
        failed = owner.spawn(fail())
        await asyncio.wait_for(asyncio.wait([failed]), REPLY_TIMEOUT_S)
    assert any(r.exc_info and "background work broke" in str(r.exc_info[1]) for r in caplog.records)
    assert not forever.done()
    await asyncio.wait_for(owner.cancel_all(), REPLY_TIMEOUT_S)
    assert forever.cancelled()


async def test_the_record_of_large_replies_stays_small_when_nobody_asks() -> None:
    """Each large reply leaves a send tracker; every send prunes the ones that left, so over
    thousands of replies (a version each) the record does not grow."""
    async with spoken_to() as (served, peer):
        endpoint = served.endpoint
        big = DataReply(x=np.ones((128, 256), np.float32), y=np.zeros(128, np.int64))
        largest = 0
        for batch in range(150):
            for i in range(10):
                endpoint.reply(peer, batch * 10 + i, big)
            for _ in range(10):
                await served.reply()
            largest = max(largest, len(endpoint._in_flight[peer].entries))
        assert largest <= 20


async def test_copied_leased_replies_leave_no_record_behind() -> None:
    """A leased reply between ``TRACK_ABOVE`` and ``COPY_BELOW`` bytes (a fused reply of a
    small model, one per round) is copied, so its send leaves no tracker: it stops counting
    once queued, and its record goes with it."""
    async with spoken_to() as (served, peer):
        endpoint = served.endpoint
        pool = BufferPool((TRACK_ABOVE + COPY_BELOW) // 2 // 4)
        largest = 0
        for request_id in range(200):
            buffer, lease = pool.acquire()
            reply = DataReply(x=buffer.numpy(), y=np.zeros(1, np.int64))
            endpoint.reply(peer, request_id, reply, lease)
            lease.release()
            await served.reply()
            record = endpoint._in_flight.get(peer)
            largest = max(largest, len(record.entries) if record else 0)
        assert largest <= 2
        await poll_until_async(
            lambda: endpoint.in_flight(peer) == 0, REPLY_TIMEOUT_S, what="no replies in flight"
        )


@pytest.mark.parametrize("nbytes", [TRACK_ABOVE + 1, COPY_BELOW])
async def test_a_failed_send_or_one_to_a_peer_gone_frees_its_lease_and_leaves_no_record(
    nbytes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A leased send, copied or zero-copy, that fails (a frame ZeroMQ cannot send) or goes to
    an identity nobody has: its lease is freed, it stops counting in flight and no record of
    it stays."""
    async with spoken_to() as (served, peer):
        endpoint = served.endpoint
        pool = BufferPool(nbytes // 4)
        with caplog.at_level(logging.ERROR, logger="pserver.transport"):
            for identity, frames in ((peer, [object()]), (b"gone", [bytes(nbytes)])):
                _, lease = pool.acquire()
                endpoint.send(identity, frames, lease, nbytes)
                lease.release()
                await poll_until_async(lease.free, REPLY_TIMEOUT_S, what="the lease free")
                assert endpoint.in_flight(identity) == 0
                assert identity not in endpoint._in_flight
        assert len(caplog.records) == 1  # the failed send
