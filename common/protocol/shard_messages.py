"""Messages between the coordinator and its parameter shards (docs/protocol.md, "Shards").

A shard says hello to the coordinator, proving it holds the run's shard secret, and is given its
range of the flat state; from then on
the coordinator drives it with requests that carry the run's shard ``key``: is a task's
gradient complete (``staged``), compute an update (``prepare``), then ``publish`` or ``abort``
it, forget tasks (``drop``), hand over its state (``capture``), are you alive
(``ping``) and stop (``shutdown``).
"""

from __future__ import annotations

import numpy as np

from common.protocol.base import Message, by_type


class ShardHello(Message):
    """A shard server offers itself; ``address`` is where workers and the coordinator reach it.
    ``proof`` shows that it holds the run's shard secret (``security.hello_proof``)."""

    address: str
    name: str
    proof: str


class ShardWelcome(Message):
    """The shard's assignment: state elements ``[lo, hi)`` with the optimizer settings, the
    initial state slice and (after a resume) the optimizer slots over its parameter part;
    ``store_token_key`` checks the workers' store and push tokens (never their coordinator
    tokens). The shard exits when the coordinator stays silent for ``dead_after_s``."""

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


class StagedRequest(Message):
    """Wait until every chunk of ``task_id``'s gradient (from ``worker_id``) is in."""

    key: str
    task_id: int
    worker_id: int
    timeout_s: float


class StagedReply(Message):
    """The shard's part of a push: all finite, and its squared norms (gradient, buffer change)."""

    finite: bool
    grad_sq: float
    buffer_sq: float


class PrepareRequest(Message):
    """Compute version ``version`` from the staged gradients of ``task_ids`` (summed in this
    order with ``weights``) with the base learning rate times ``lr_scale`` and factor
    ``buffer_scale`` on buffer changes; keep it as a candidate until ``publish`` or ``abort``."""

    key: str
    version: int
    task_ids: list[int]
    weights: list[float]
    lr_scale: float
    buffer_scale: float


class PrepareReply(Message):
    """Whether the candidate is valid (finite; variances not negative), and why not."""

    ok: bool
    reason: str


class PublishRequest(Message):
    """Publish the candidate of ``version``: it answers the gradient chunks of its tasks with
    the new parameters."""

    key: str
    version: int


class AbortRequest(Message):
    """Discard the candidate of ``version``, answering its tasks' chunks with error ``code``."""

    key: str
    version: int
    code: int
    message: str


class DropRequest(Message):
    """Forget the gradients of ``task_ids`` and answer their chunks with error ``code``."""

    key: str
    task_ids: list[int]
    code: int
    message: str


class CaptureRequest(Message):
    """Hand over the published state slice, with the optimizer slots for a checkpoint."""

    key: str
    with_slots: bool


class StateReply(Message):
    """A shard's published state slice and its optimizer slots, one row per slot name."""

    version: int
    optimizer_steps: int
    slots: list[str]
    state: np.ndarray
    slot_state: np.ndarray


class PingRequest(Message):
    """Are you alive?"""

    key: str


class PingReply(Message):
    """Alive, at ``version``, holding ``staged`` gradients."""

    version: int
    staged: int


class ShutdownRequest(Message):
    """Training is over: answer what is pending and exit."""

    key: str
    reason: str


class AckReply(Message):
    """Done."""


CONTROL_REQUESTS = by_type(
    StagedRequest,
    PrepareRequest,
    PublishRequest,
    AbortRequest,
    DropRequest,
    CaptureRequest,
    PingRequest,
    ShutdownRequest,
)
CONTROL_REPLIES = by_type(ShardWelcome, StagedReply, PrepareReply, StateReply, PingReply, AckReply)
