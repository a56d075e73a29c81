"""The project's exception hierarchy and the error codes carried in error replies."""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes sent in ``status: error`` replies; each has one meaning."""

    BAD_FRAME = 1  # frames could not be parsed (garbage, truncated msgpack, non-map header)
    BAD_VERSION = 2  # protocol version differs from the server's
    UNKNOWN_TYPE = 3  # message type is not part of the protocol
    BAD_FIELD = 4  # a header field is missing, of the wrong type or out of range
    BAD_TENSOR = 5  # tensor descriptor/frame mismatch, forbidden dtype or wrong size
    NON_FINITE = 6  # a gradient or statistic contains NaN or Inf
    UNKNOWN_WORKER = 7  # the worker id is not a member of this server
    STALE = 8  # the push is older than --max-staleness allows; re-pull and recompute
    WRONG_TASK = 9  # the push does not answer the task the worker was given
    SHUTTING_DOWN = 10  # the server is stopping and takes no more work
    INTERNAL = 11  # the server failed while handling a valid request
    INCOMPLETE = 12  # not every chunk of the push's gradient reached its store in time
    REFUSED = 13  # the gradient or the update it makes was refused (outlier, invalid state)
    BUSY = 14  # too much of this peer's data is in flight; retry later
    UNAUTHORIZED = 15  # a shard's hello does not prove the run's shard secret


class PSError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(PSError):
    """A configuration value is invalid; the message quotes the bad value."""


class DatasetError(PSError):
    """A dataset file or source file is missing, malformed or inconsistent."""


class ModelError(PSError):
    """A model name or factory cannot be resolved or built."""


class ProtocolError(PSError):
    """A message broke the wire protocol.

    Attributes:
        code: the ``ErrorCode`` to send back to the peer.
        request_id: the id of the offending request when it could be read, else 0.
    """

    def __init__(self, code: ErrorCode, message: str, *, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.request_id = request_id


class RemoteError(PSError):
    """The peer answered a request with an error reply.

    Attributes:
        code: the ``ErrorCode`` the peer sent.
    """

    def __init__(self, code: int, message: str) -> None:
        name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
        super().__init__(f"{name}: {message}")
        self.code = code
        self.remote_message = message
        self.request_id = 0


class NetworkTimeout(PSError):
    """A network wait ran past its configured timeout."""


class WaitTimeout(PSError):
    """A bounded wait for a condition (``common.polling.poll_until``) ran out of time."""


class ServerLost(PSError):
    """The server stopped answering heartbeats or restarted; the worker should rejoin."""


class RunFailed(PSError):
    """The server ended the run because of a failure (a lost parameter shard)."""


class DeviceError(PSError):
    """The requested compute device is not available."""


class ShardLost(PSError):
    """A parameter shard stopped answering; the message names it."""
