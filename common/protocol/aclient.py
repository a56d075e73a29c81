"""An asyncio request/reply connection that may have many requests in flight at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from common.errors import ErrorCode, NetworkTimeout, ProtocolError, RemoteError
from common.protocol.base import Message, parse_message
from common.protocol.security import ClientKeys

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


class AsyncConnection:
    """One DEALER socket; replies are matched to their requests by request id.

    It owns one reader task, started by ``start`` and cancelled by ``close``.

    Args:
        context: the asyncio ZeroMQ context.
        address: the peer's endpoint.
        replies: the reply types this peer may send.
        curve: CURVE keys, when the peer requires them.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        address: str,
        *,
        replies: dict[str, type[Message]],
        curve: ClientKeys | None = None,
    ) -> None:
        self.address, self.replies = address, replies
        self._sock = context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start reading replies (call on the event loop)."""
        self._reader = asyncio.create_task(self._read(), name=f"replies from {self.address}")

    async def request(self, message: Message, timeout_s: float, expect: type[M]) -> M:
        """Send ``message`` and wait for its reply.

        Raises:
            NetworkTimeout: no reply within ``timeout_s``.
            RemoteError: the peer answered with an error.
            ProtocolError: the reply is not an ``expect``.
        """
        request_id = next(self._ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            await self._sock.send_multipart(message.to_wire(request_id), copy=False)
            reply = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise NetworkTimeout(
                f"no reply to {message.TYPE} from {self.address} within {timeout_s:g} s"
            ) from None
        finally:
            self._waiting.pop(request_id, None)
        if not isinstance(reply, expect):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"expected {expect.TYPE}, got {reply.TYPE}")
        return reply

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                reply, request_id = parse_message(frames, self.replies)
                outcome: Any = reply
            except (RemoteError, ProtocolError) as exc:
                request_id, outcome = exc.request_id, exc
            future = self._waiting.get(request_id)
            if future is None or future.done():
                continue  # a late reply to a request that timed out
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    async def close(self) -> None:
        """Stop reading and close the socket; waiting requests are cancelled."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for future in self._waiting.values():
            future.cancel()
        self._sock.close(linger=0)
