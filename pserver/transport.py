"""A server's ROUTER socket: binding (with CURVE), the receive loop, replies with zero-copy
buffer leases, per-peer bounds on bytes in flight, and the tasks that own all of it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from common import stagetrace
from common.errors import ConfigError, ErrorCode, ProtocolError, RemoteError
from common.protocol.base import Message, error_frames, parse_message
from common.protocol.security import AuthorizedKeys, is_loopback, load_server_secret
from pserver.errorlog import RateLimitedLog
from pserver.store.pool import Lease

log = logging.getLogger(__name__)

COPY_BELOW = 1 << 19  # leased replies of fewer bytes are copied, not sent zero-copy
TRACK_ABOVE = 1 << 16  # replies of more bytes count as in flight until they left


@dataclasses.dataclass(frozen=True)
class Request:
    """Who sent a request: the routing identity, the request id and (CURVE) the public key."""

    identity: bytes
    request_id: int
    user_id: str = ""


Dispatch = Callable[[Request, Message], Awaitable[None]]


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


class _InFlight:
    """Bytes queued for one peer and not yet handed to the network.

    Each send is an entry ``[nbytes, tracker or None]``: it counts until it was queued
    without a tracker (copied, or failed: ``_tracked`` sets its bytes to 0) or its tracker is
    done; ``total`` forgets the entries that stopped counting.
    """

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []

    def total(self) -> int:
        self.entries = [e for e in self.entries if e[0] and (e[1] is None or not e[1].done)]
        return sum(e[0] for e in self.entries)


class Endpoint:
    """One ROUTER socket that parses every request and hands valid ones to ``dispatch``.

    Malformed frames are answered with an error reply here; ``dispatch`` runs as an owned task
    per request, so a slow request never blocks the receive loop.

    Args:
        bind: ``tcp://HOST:PORT`` (port 0 picks a free port).
        requests: the request types this endpoint serves.
        max_message_bytes: ZeroMQ drops larger messages before buffering them.
        owner: owns the send and handling tasks.
        curve_secret, authorized_keys: turn on CURVE; only listed public keys may connect.
        allow_own_key: also accept clients using this server's own key pair (a shard accepts
            its coordinator this way).
    """

    def __init__(
        self,
        bind: str,
        requests: dict[str, type[Message]],
        *,
        max_message_bytes: int,
        owner: TaskOwner,
        curve_secret: Path | None = None,
        authorized_keys: Path | None = None,
        allow_own_key: bool = False,
    ) -> None:
        self.bind_to, self.requests = bind, requests
        self.allow_own_key = allow_own_key
        self.max_message_bytes, self.owner = max_message_bytes, owner
        self.curve_secret, self.authorized_keys = curve_secret, authorized_keys
        self.address = ""
        self.context = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._errors = RateLimitedLog(log)
        self._in_flight: dict[bytes, _InFlight] = {}

    def bind(self) -> str:
        """Bind the socket; returns the address peers connect to.

        Raises:
            ConfigError: the address cannot be bound (in use, not local, malformed).
        """
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self._secure(sock)
        bind = self.bind_to
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"cannot listen on {self.bind_to}: {exc}") from None
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
        extra = (public,) if self.allow_own_key else ()
        keys = AuthorizedKeys(self.authorized_keys, extra)
        self._auth = AsyncioAuthenticator(self.context)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        log.info("CURVE on: only keys in %s may connect", self.authorized_keys)

    def in_flight(self, identity: bytes) -> int:
        """Bytes of replies to ``identity`` not yet handed to the network."""
        entry = self._in_flight.get(identity)
        if entry is None:
            return 0
        total = entry.total()
        if not entry.entries:
            del self._in_flight[identity]
        return total

    def send(
        self, identity: bytes, frames: list[Any], lease: Lease | None = None, nbytes: int = 0
    ) -> None:
        """Queue ``nbytes`` of frames for ``identity``, holding ``lease`` until they are sent:
        copied below ``COPY_BELOW`` (cheaper than tracking a zero-copy send), else zero-copy."""
        if self._sock is None:
            return
        if lease is not None:
            lease.hold()
        entry: list[Any] | None = None
        if nbytes > TRACK_ABOVE:
            # Every send prunes its peer's record (and now and then every peer's), so replies
            # that left are forgotten even when nobody asks what is in flight.
            for peer in list(self._in_flight) if len(self._in_flight) > 64 else [identity]:
                self.in_flight(peer)
            entry = [nbytes, None]
            self._in_flight.setdefault(identity, _InFlight()).entries.append(entry)
        copy = lease is not None and nbytes < COPY_BELOW
        watch = lease is not None or entry is not None
        future = cast(
            "asyncio.Future[Any]",
            self._sock.send_multipart([identity, *frames], copy=copy, track=watch and not copy),
        )
        if watch:
            future.add_done_callback(lambda f: _tracked(f, lease, entry))
        self.owner.spawn(future)

    def reply(
        self, identity: bytes, request_id: int, message: Message, lease: Lease | None = None
    ) -> None:
        """Send ``message`` as the reply to ``request_id``."""
        frames = message.to_wire(request_id)
        stagetrace.mark("reply", type=message.TYPE)
        nbytes = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        self.send(identity, frames, lease, nbytes)

    def reply_error(self, identity: bytes, request_id: int, code: ErrorCode, text: str) -> None:
        """Send an error reply (and log it, rate-limited per code; SHUTTING_DOWN, the expected
        answer to requests that arrive while any run ends, only at debug level)."""
        args = ("rejected request %d: %s: %s", request_id, code.name, text)
        if code == ErrorCode.SHUTTING_DOWN:
            log.debug(*args)
        else:
            self._errors.warning(code.name, *args)
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
                message, request_id = parse_message(frames[1:], self.requests)
            except ProtocolError as exc:
                self.reply_error(identity, exc.request_id, exc.code, str(exc))
                continue
            except RemoteError as exc:
                self.reply_error(
                    identity, 0, ErrorCode.BAD_FIELD, f"servers take requests, not errors ({exc})"
                )
                continue
            stagetrace.mark("request", type=message.TYPE)
            user_id = _user_id(frames[1]) if self._auth is not None else ""
            request = Request(identity, request_id, user_id)
            self.owner.spawn(self._handle(dispatch, request, message))

    async def _handle(self, dispatch: Dispatch, request: Request, message: Message) -> None:
        try:
            await dispatch(request, message)
        except ProtocolError as exc:
            self.reply_error(request.identity, request.request_id, exc.code, str(exc))
        except Exception as exc:
            log.exception("failed to handle %s", message.TYPE)
            self.reply_error(
                request.identity,
                request.request_id,
                ErrorCode.INTERNAL,
                f"{type(exc).__name__}: {exc}",
            )

    def close(self) -> None:
        """Close the socket, the authenticator and the context."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
        self.context.term()


def _tracked(future: asyncio.Future[Any], lease: Lease | None, entry: list[Any] | None) -> None:
    """A send was queued: hand its tracker to the lease and the in-flight count."""
    tracker = None if future.cancelled() or future.exception() else future.result()
    if lease is not None:
        if tracker is not None:
            lease.track(tracker)
        lease.release()
    if entry is not None:
        if tracker is None:
            entry[0] = 0
        else:
            entry[1] = tracker


def _user_id(frame: Any) -> str:
    """The CURVE public key (z85) the authenticator attached to a frame, or ""."""
    try:
        value = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return ""
    return value or ""
