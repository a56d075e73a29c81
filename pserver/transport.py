"""The server's ROUTER socket: binding (with CURVE), the receive loop, replies, and the
background tasks that sending and handling need."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from common.errors import ErrorCode, ProtocolError, RemoteError
from common.protocol.messages import REQUESTS, Message, error_frames, parse_message
from common.protocol.security import is_loopback, load_server_secret
from pserver.errorlog import RateLimitedLog

log = logging.getLogger(__name__)

Dispatch = Callable[[bytes, int, Message], Awaitable[None]]


class TaskOwner:
    """Owns background work: every task is tracked, its failure logged, and all are cancelled
    and awaited on ``cancel_all`` (no fire-and-forget)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``work`` in the background."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    async def wait(self) -> None:
        """Wait for everything spawned so far (failures are logged, not raised)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel and await every task."""
        pending = list(self._tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())


class Endpoint:
    """One ROUTER socket that parses every request and hands valid ones to ``dispatch``.

    Malformed frames are answered with an error reply here; ``dispatch`` runs as a background
    task per request, so a slow request never blocks the receive loop.

    Args:
        bind: ``tcp://HOST:PORT`` (port 0 picks a free port).
        max_message_bytes: ZeroMQ drops larger messages before buffering them.
        curve_secret, authorized_keys: turn on CURVE; only listed public keys may connect.
        owner: owns the send and handling tasks.
    """

    def __init__(
        self,
        bind: str,
        max_message_bytes: int,
        owner: TaskOwner,
        curve_secret: Path | None = None,
        authorized_keys: Path | None = None,
    ) -> None:
        self.bind_to, self.max_message_bytes, self.owner = bind, max_message_bytes, owner
        self.curve_secret, self.authorized_keys = curve_secret, authorized_keys
        self.address = ""
        self._context = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._errors = RateLimitedLog(log)

    def bind(self) -> str:
        """Bind the socket; returns the address workers connect to."""
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self._secure(sock)
        bind = self.bind_to
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        sock.bind(bind)
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def _secure(self, sock: zmq.asyncio.Socket) -> None:
        """Turn on CURVE with an authenticator, or warn when serving the network in clear."""
        if self.curve_secret is None or self.authorized_keys is None:
            if not is_loopback(self.bind_to):
                log.warning(
                    "binding %s without CURVE: anyone who reaches this port can join, read "
                    "the data and push gradients; use 'pserver keygen' and --curve-secret",
                    self.bind_to,
                )
            return
        public, secret = load_server_secret(self.curve_secret)
        self._auth = AsyncioAuthenticator(self._context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(self.authorized_keys))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        log.info("CURVE on: only keys in %s may connect", self.authorized_keys)

    def send(self, identity: bytes, frames: list[Any]) -> None:
        """Queue frames for ``identity`` (zero-copy for large frames)."""
        assert self._sock is not None
        self.owner.spawn(self._sock.send_multipart([identity, *frames], copy=False))

    def reply(self, identity: bytes, request_id: int, message: Message) -> None:
        """Send ``message`` as the reply to ``request_id``."""
        self.send(identity, message.to_wire(request_id))

    def reply_error(self, identity: bytes, request_id: int, code: ErrorCode, text: str) -> None:
        """Send an error reply (and log it, rate-limited per code)."""
        self._errors.warning(code.name, "rejected request %d: %s: %s", request_id, code.name, text)
        self.send(identity, error_frames(request_id, code, text))

    async def receive_loop(self, dispatch: Dispatch) -> None:
        """Receive forever; cancel to stop."""
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            if len(frames) < 2:
                continue  # nothing but a routing id: there is no request to answer
            try:
                message, request_id = parse_message(frames[1:], REQUESTS)
            except ProtocolError as exc:
                self.reply_error(identity, exc.request_id, exc.code, str(exc))
                continue
            except RemoteError as exc:
                self.reply_error(
                    identity,
                    0,
                    ErrorCode.BAD_FIELD,
                    f"servers take requests, not error replies ({exc})",
                )
                continue
            self.owner.spawn(self._handle(dispatch, identity, request_id, message))

    async def _handle(
        self, dispatch: Dispatch, identity: bytes, request_id: int, message: Message
    ) -> None:
        try:
            await dispatch(identity, request_id, message)
        except ProtocolError as exc:
            self.reply_error(identity, request_id, exc.code, str(exc))
        except Exception as exc:
            log.exception("failed to handle %s", message.TYPE)
            self.reply_error(
                identity, request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            )

    def close(self) -> None:
        """Close the socket, the authenticator and the context."""
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
