"""Helpers for tests that talk to a live in-process server over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from common.errors import RemoteError
from common.protocol.messages import REPLIES, Message, parse_message
from pserver.config import ServerConfig
from pserver.server import ParameterServer

REPLY_TIMEOUT_S = 20.0


class AsyncClient:
    """A DEALER client for the event loop the server runs in (real TCP on 127.0.0.1)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._ids = itertools.count(1)

    async def send_raw(self, frames: list[Any]) -> list[bytes]:
        """Send arbitrary frames and return the reply frames."""
        await self.sock.send_multipart(frames)
        return await asyncio.wait_for(self.sock.recv_multipart(), REPLY_TIMEOUT_S)

    async def request(self, message: Message) -> Message:
        """Send a well-formed request and return the parsed reply (raises RemoteError)."""
        rid = next(self._ids)
        await self.sock.send_multipart(message.to_wire(rid))
        frames = await asyncio.wait_for(self.sock.recv_multipart(), REPLY_TIMEOUT_S)
        reply, reply_id = parse_message(frames, REPLIES)
        assert reply_id == rid
        return reply

    async def expect_error(self, message: Message) -> RemoteError:
        """Send ``message`` and return the error reply it must get."""
        try:
            await self.request(message)
        except RemoteError as exc:
            return exc
        raise AssertionError(f"{message.TYPE} was accepted")

    def close(self) -> None:
        self.sock.close(linger=0)


@contextlib.asynccontextmanager
async def live_server(dataset: Path, **options: Any) -> AsyncIterator[ParameterServer]:
    """A started server on a random port, serving in the background until the block ends."""
    settings: dict[str, Any] = {
        "model": "hsi-cnn",
        "bind": "tcp://127.0.0.1:0",
        "epochs": 1,
        "shutdown_timeout_s": 0.5,
    }
    settings.update(options)
    config = ServerConfig(dataset=dataset, **settings).validate()
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
