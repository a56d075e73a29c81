"""Messages between the coordinator and its parameter shards (docs/protocol.md, "Shards").

A shard says hello to the coordinator, proving it holds the run's shard secret, and is given its
range of the flat state; from then on
the coordinator drives it with requests that carry the run's shard ``key``: is a task's
gradient complete (``staged``), compute an update (``prepare``), then ``publish`` or ``abort``
it, forget tasks (``drop``), hand over its state (``capture``), are you alive
(``ping``) and stop (``shutdown``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from common.protocol.base import Message


@dataclasses.dataclass(frozen=True)
class ShardHello(Message):
    """A shard server offers itself; ``address`` is where workers and the coordinator reach it.
    ``proof`` shows that it holds the run's shard secret (``security.hello_proof``)."""

    TYPE: ClassVar[str] = "shard_hello"
    address: str
    name: str
    proof: str


@dataclasses.dataclass(frozen=True)
class ShardWelcome(Message):
    """The shard's assignment: state elements ``[lo, hi)`` with the optimizer settings, the
    initial state slice and (after a resume) the optimizer slots over its parameter part;
    ``store_token_key`` checks the workers' store and push tokens (never their coordinator
    tokens). The shard exits when the coordinator stays silent for ``dead_after_s``."""

    TYPE: ClassVar[str] = "shard_welcome"
    index: int
    key: str
    store_token_key: str
    lo: int
    hi: int
    num_params: int
    wire_dtype: str
    chunk_elems: int
    optimizer: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    version: int
    optimizer_steps: int
    dead_after_s: float
    nonneg_bounds: list[int]
    slots: list[str]
    state: np.ndarray
    slot_state: np.ndarray


@dataclasses.dataclass(frozen=True)
class StagedRequest(Message):
    """Wait until every chunk of ``task_id``'s gradient (from ``worker_id``) is in."""

    TYPE: ClassVar[str] = "staged_request"
    key: str
    task_id: int
    worker_id: int
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class StagedReply(Message):
    """The shard's part of a push: all finite, and its squared norms (gradient, buffer change)."""

    TYPE: ClassVar[str] = "staged_reply"
    finite: bool
    grad_sq: float
    buffer_sq: float


@dataclasses.dataclass(frozen=True)
class PrepareRequest(Message):
    """Compute version ``version`` from the staged gradients of ``task_ids`` (summed in this
    order with ``weights``) with the base learning rate times ``lr_scale`` and factor
    ``buffer_scale`` on buffer changes; keep it as a candidate until ``publish`` or ``abort``."""

    TYPE: ClassVar[str] = "prepare_request"
    key: str
    version: int
    task_ids: list[int]
    weights: list[float]
    lr_scale: float
    buffer_scale: float


@dataclasses.dataclass(frozen=True)
class PrepareReply(Message):
    """Whether the candidate is valid (finite; variances not negative), and why not."""

    TYPE: ClassVar[str] = "prepare_reply"
    ok: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class PublishRequest(Message):
    """Publish the candidate of ``version``: it answers the gradient chunks of its tasks with
    the new parameters."""

    TYPE: ClassVar[str] = "publish_request"
    key: str
    version: int


@dataclasses.dataclass(frozen=True)
class AbortRequest(Message):
    """Discard the candidate of ``version``, answering its tasks' chunks with error ``code``."""

    TYPE: ClassVar[str] = "abort_request"
    key: str
    version: int
    code: int
    message: str


@dataclasses.dataclass(frozen=True)
class DropRequest(Message):
    """Forget the gradients of ``task_ids`` and answer their chunks with error ``code``."""

    TYPE: ClassVar[str] = "drop_request"
    key: str
    task_ids: list[int]
    code: int
    message: str


@dataclasses.dataclass(frozen=True)
class CaptureRequest(Message):
    """Hand over the published state slice, with the optimizer slots for a checkpoint."""

    TYPE: ClassVar[str] = "capture_request"
    key: str
    with_slots: bool


@dataclasses.dataclass(frozen=True)
class StateReply(Message):
    """A shard's published state slice and its optimizer slots, one row per slot name."""

    TYPE: ClassVar[str] = "state_reply"
    version: int
    optimizer_steps: int
    slots: list[str]
    state: np.ndarray
    slot_state: np.ndarray


@dataclasses.dataclass(frozen=True)
class PingRequest(Message):
    """Are you alive?"""

    TYPE: ClassVar[str] = "ping_request"
    key: str


@dataclasses.dataclass(frozen=True)
class PingReply(Message):
    """Alive, at ``version``, holding ``staged`` gradients."""

    TYPE: ClassVar[str] = "ping_reply"
    version: int
    staged: int


@dataclasses.dataclass(frozen=True)
class ShutdownRequest(Message):
    """Training is over: answer what is pending and exit."""

    TYPE: ClassVar[str] = "shutdown_request"
    key: str
    reason: str


@dataclasses.dataclass(frozen=True)
class AckReply(Message):
    """Done."""

    TYPE: ClassVar[str] = "ack_reply"


CONTROL_REQUESTS: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (
        StagedRequest,
        PrepareRequest,
        PublishRequest,
        AbortRequest,
        DropRequest,
        CaptureRequest,
        PingRequest,
        ShutdownRequest,
    )
}
CONTROL_REPLIES: dict[str, type[Message]] = {
    m.TYPE: m for m in (ShardWelcome, StagedReply, PrepareReply, StateReply, PingReply, AckReply)
}
