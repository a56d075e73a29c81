"""Helpers for tests that talk to a live in-process server over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import zmq
import zmq.asyncio

from common.errors import RemoteError, WaitTimeout
from common.protocol.chunks import chunk_spans, encode
from common.protocol.messages import (
    REPLIES,
    GradientChunk,
    GradientPushRequest,
    JoinReply,
    JoinRequest,
    Message,
    ParamsChunk,
    PushRequest,
    TaskReply,
    TaskRequest,
    parse_message,
)
from pserver.config import ServerConfig
from pserver.server import ParameterServer

REPLY_TIMEOUT_S = 20.0
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Member:
    """A joined worker as the tests see it."""

    join: JoinReply

    @property
    def worker_id(self) -> int:
        return self.join.worker_id

    @property
    def token(self) -> str:
        return self.join.token


class AsyncClient:
    """A DEALER client for the event loop the server runs in (real TCP on 127.0.0.1).

    Several requests may be in flight; replies are matched by request id.
    """

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.ctx, self.address = ctx, address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._ids = itertools.count(1)
        self._early: dict[int, Any] = {}
        self._stores: dict[str, AsyncClient] = {}

    def store(self, address: str) -> AsyncClient:
        """The client for a parameter store ("" is the server itself)."""
        if not address:
            return self
        if address not in self._stores:
            self._stores[address] = AsyncClient(self.ctx, address)
        return self._stores[address]

    async def send_raw(self, frames: list[Any]) -> list[bytes]:
        """Send arbitrary frames and return the reply frames."""
        await self.sock.send_multipart(frames)
        return await asyncio.wait_for(self.sock.recv_multipart(), REPLY_TIMEOUT_S)

    async def send(self, message: Message) -> int:
        """Send a well-formed request; returns its request id."""
        rid = next(self._ids)
        await self.sock.send_multipart(message.to_wire(rid))
        return rid

    async def receive(self, rid: int) -> Message:
        """The reply to request ``rid`` (raises RemoteError for an error reply)."""
        while rid not in self._early:
            frames = await asyncio.wait_for(self.sock.recv_multipart(), REPLY_TIMEOUT_S)
            try:
                reply, reply_id = parse_message(frames, REPLIES)
                self._early[reply_id] = reply
            except RemoteError as exc:
                self._early[exc.request_id] = exc
        outcome = self._early.pop(rid)
        if isinstance(outcome, RemoteError):
            raise outcome
        return outcome

    async def request(self, message: Message) -> Message:
        """Send a well-formed request and return the parsed reply (raises RemoteError)."""
        return await self.receive(await self.send(message))

    async def expect_error(self, message: Message) -> RemoteError:
        """Send ``message`` and return the error reply it must get."""
        try:
            await self.request(message)
        except RemoteError as exc:
            return exc
        raise AssertionError(f"{message.TYPE} was accepted")

    async def join(self, name: str, speed: float = 100.0) -> tuple[Member, TaskReply]:
        """Join, then ask for the first task (waits until training starts)."""
        join = await self.request(JoinRequest(name=name, device="cpu", slowdown=1.0, threads=1))
        assert isinstance(join, JoinReply)
        member = Member(join)
        task = await self.request(
            TaskRequest(worker_id=join.worker_id, token=join.token, speed=speed)
        )
        assert isinstance(task, TaskReply) and task.action == "train"
        return member, task

    async def send_gradient(
        self, member: Member, task: TaskReply, values: np.ndarray, **changes: Any
    ) -> list[tuple[AsyncClient, int]]:
        """Send every chunk of ``values`` to its store (``changes`` override chunk fields, the
        raw ``gradient`` array included); returns (store client, request id) per chunk."""
        sent = []
        for start, stop, store in self._chunks(member.join):
            chunk = gradient_chunk(member, task, start, values[start:stop], **changes)
            sent.append((store, await store.send(chunk)))
        return sent

    def _chunks(self, join: JoinReply) -> list[tuple[int, int, AsyncClient]]:
        bounds = join.shard_bounds
        return [
            (start, stop, self.store(address))
            for address, lo, hi in zip(join.shard_addresses, bounds[:-1], bounds[1:], strict=True)
            for start, stop in chunk_spans(lo, hi, join.chunk_elems)
        ]

    async def push(
        self, member: Member, task: TaskReply, gradient: np.ndarray, **changes: Any
    ) -> Message:
        """Push a gradient (chunks, then the push request) and return the push's reply; the
        chunks' answers are read too (they must be parameters when the push made a version;
        a sync round that goes on answers them when it closes)."""
        chunks = await self.send_gradient(member, task, gradient)
        rid = await self.send(push_request(member, task, **changes))
        reply = await self.receive(rid)
        if (
            isinstance(reply, TaskReply)
            and reply.action == "train"
            and reply.version > task.version
        ):
            for store, rid in chunks:
                assert isinstance(await store.receive(rid), ParamsChunk)
        return reply

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self.sock.close(linger=0)


def push_request(member: Member, task: TaskReply, **changes: Any) -> PushRequest:
    """The push request answering ``task`` (fields may be changed)."""
    fields = dict(
        worker_id=member.worker_id,
        token=member.token,
        task_id=task.task_id,
        version=task.version,
        batch_size=len(task.indices),
        speed=100.0,
        compute_s=0.01,
        transfer_s=0.0,
        loss=1.0,
    )
    fields.update(changes)
    return PushRequest(**fields)


def gradient_chunk(
    member: Member, task: TaskReply, start: int, values: np.ndarray, **changes: Any
) -> GradientChunk:
    """The chunk at ``start`` of the gradient answering ``task`` (fields may be changed, the
    raw ``gradient`` array included)."""
    data, scale = encode(torch.from_numpy(values), member.join.wire_dtype)
    fields: dict[str, Any] = dict(
        worker_id=member.worker_id,
        token=task.push_token,
        task_id=task.task_id,
        version=task.version,
        offset=start,
        scale=scale,
        gradient=data,
    )
    return GradientChunk(**{**fields, **changes})


def gradient_push(
    member: Member, task: TaskReply, gradient: np.ndarray, **changes: Any
) -> GradientPushRequest:
    """The push answering ``task`` with ``gradient`` inside (fields may be changed)."""
    data, scale = encode(torch.from_numpy(gradient), member.join.wire_dtype)
    fields = {**vars(push_request(member, task)), "push_token": task.push_token}
    fields.update({"scale": scale, "gradient": data, **changes})
    return GradientPushRequest(**fields)


def published(ps: ParameterServer) -> torch.Tensor:
    """A copy of the single-server run's published state."""
    return ps.stores.store.state.clone()  # type: ignore[union-attr]


@contextlib.asynccontextmanager
async def live_server(dataset: Path, **options: Any) -> AsyncIterator[ParameterServer]:
    """A started server on a random port, serving in the background until the block ends."""
    settings: dict[str, Any] = {
        "model": "hsi-cnn",
        "bind": "tcp://127.0.0.1:0",
        "epochs": 1,
        "shutdown_timeout_s": 2.0,
    }
    settings.update(options)
    config = ServerConfig(dataset=dataset, **settings)
    async with ParameterServer(config) as server:
        serving = asyncio.create_task(server.serve())
        try:
            yield server
        finally:
            server.request_stop()
            await asyncio.wait_for(serving, 30)


@contextlib.asynccontextmanager
async def clients(address: str, count: int) -> AsyncIterator[list[AsyncClient]]:
    """``count`` connected clients, closed at the end."""
    ctx = zmq.asyncio.Context()
    made = [AsyncClient(ctx, address) for _ in range(count)]
    try:
        yield made
    finally:
        for client in made:
            client.close()
        ctx.term()


@contextlib.asynccontextmanager
async def live_sharded(dataset: Path, shards: int, **options: Any) -> AsyncIterator[Any]:
    """A started coordinator with ``shards`` shard servers, all on this event loop."""
    from pserver.config import ShardConfig
    from pserver.store.shard_server import ShardServer
    from tests.support.cluster import shard_secret

    servers: list[ShardServer] = []
    running: list[asyncio.Task[str]] = []
    options.setdefault("shard_secret_file", shard_secret())
    try:
        async with live_server(dataset, shards=shards, **options) as ps:
            config = ShardConfig(
                coordinator=ps.address,
                bind="tcp://127.0.0.1:0",
                secret_file=options["shard_secret_file"],
            )
            servers = [ShardServer(config) for _ in range(shards)]
            running = [asyncio.create_task(s.run()) for s in servers]
            await asyncio.wait_for(ps.stores.ready.wait(), 30)
            yield ps
    finally:
        # The coordinator told its shards to stop when it closed.
        await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
        for server in servers:
            await server.close()


async def poll_until_async(
    predicate: Callable[[], T | None],
    timeout: float,
    interval: float = 0.01,
    what: str = "the condition",
) -> T:
    """``common.polling.poll_until`` for a coroutine: the event loop runs between the calls.

    Args:
        predicate: what is waited for (a plain function; it must not block).
        timeout: seconds to wait at most.
        interval: seconds between calls.
        what: what is waited for, for the error message.

    Returns:
        The predicate's first truthy result.

    Raises:
        WaitTimeout: the predicate stayed falsy for ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if result:
            return result
        left = deadline - loop.time()
        if left <= 0:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(min(interval, left))
