"""A blocking request/reply connection to the server over a ZeroMQ DEALER socket."""

from __future__ import annotations

import itertools
import time
from typing import TypeVar

import zmq

from common.errors import (
    ConfigError,
    ErrorCode,
    NetworkTimeout,
    ProtocolError,
    RemoteError,
    ServerLost,
)
from common.protocol.messages import REPLIES, Message, parse_message
from common.protocol.security import ClientKeys

M = TypeVar("M", bound=Message)


class Connection:
    """Sends one request at a time and waits for its reply, ignoring late replies to earlier
    requests. Not thread-safe: use one per thread.

    Args:
        address: the server endpoint, e.g. ``tcp://10.0.0.1:5555``.
        timeout_s: default wait for a reply.
        context: a ZeroMQ context to share (a private one is made otherwise).
        abort: an ``inproc://`` PUB endpoint in ``context``; any message published there ends
            the current wait with ``ServerLost`` (a worker's heartbeat thread uses it).
        curve: CURVE keys, for a server started with ``--curve-secret``.

    Raises:
        ConfigError: ``address`` is not a usable endpoint.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float,
        *,
        context: zmq.Context | None = None,
        abort: str | None = None,
        curve: ClientKeys | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            if self._own_context:
                self._context.term()
            raise ConfigError(f"cannot connect to {address!r}: {exc}") from None
        self._ids = itertools.count(1)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._abort: zmq.Socket | None = None
        if abort is not None:
            self._abort = self._context.socket(zmq.SUB)
            self._abort.setsockopt(zmq.LINGER, 0)
            self._abort.setsockopt(zmq.SUBSCRIBE, b"")
            self._abort.connect(abort)
            self._poller.register(self._abort, zmq.POLLIN)

    def request(self, message: Message, timeout_s: float | None = None, *, expect: type[M]) -> M:
        """Send ``message`` and return the server's reply.

        Args:
            message: the request.
            timeout_s: how long to wait; the connection's default if None.
            expect: the reply type the request must get.

        Returns:
            The reply message.

        Raises:
            NetworkTimeout: no reply in time.
            ServerLost: the abort endpoint said the server is gone.
            RemoteError: the server answered with an error.
            ProtocolError: the reply is malformed or not an ``expect``.
        """
        request_id = next(self._ids)
        self._sock.send_multipart(message.to_wire(request_id), copy=False)
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            ready = dict(self._poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if self._abort is not None and self._abort in ready:
                raise ServerLost(self._abort.recv().decode(errors="replace"))
            if self._sock not in ready:
                raise NetworkTimeout(
                    f"no reply to {message.TYPE} from {self.address} within {limit:.0f} s"
                )
            frames = self._sock.recv_multipart(copy=False)
            try:
                reply, reply_id = parse_message(frames, REPLIES)
            except RemoteError as exc:
                if exc.request_id == request_id:
                    raise
                continue
            if reply_id == request_id:
                if not isinstance(reply, expect):
                    raise ProtocolError(
                        ErrorCode.BAD_FIELD, f"expected {expect.TYPE}, got {reply.TYPE}"
                    )
                return reply

    def close(self) -> None:
        """Close the socket (and the context if it is private)."""
        self._sock.close(linger=0)
        if self._abort is not None:
            self._abort.close(linger=0)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
