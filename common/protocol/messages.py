"""The messages between workers and the coordinator or a parameter store (docs/protocol.md).

Every request from a member carries its ``worker_id`` and a secret it got at join (``token``
for the coordinator, ``store_token`` for pulls from a parameter store), so no connection can act
for another worker.
"""

from __future__ import annotations

import numpy as np

from common.protocol.base import Message as Message
from common.protocol.base import by_type
from common.protocol.base import parse_message as parse_message
from common.protocol.ending import FinishReason

# --- worker -> coordinator ---------------------------------------------------------------------


class JoinRequest(Message):
    """A worker asks to join; the reply tells it which model to build and where the stores are.

    Optional: ``torch_version``, the worker's ``torch.__version__``; the coordinator warns when
    it differs from its own (the parameter layout itself is checked by the worker). ``host``,
    the name of the machine the worker runs on (recorded in the ``join`` event).
    """

    name: str
    device: str
    slowdown: float
    threads: int
    torch_version: str | None = None
    host: str | None = None


class TaskRequest(Message):
    """A worker asks for its next task, reporting its speed in samples/s: first after joining
    and calibrating, then to re-pull after a rejected push.

    Optional: ``calibration_batches`` and ``calibration_s``, the batch sizes and compute
    seconds of the calibration steps (equal lengths, at most 16), which seed the server's
    performance model of the worker; absent when the worker did not calibrate.
    """

    worker_id: int
    token: str
    speed: float
    calibration_batches: list[int] | None = None
    calibration_s: list[float] | None = None


class PushRequest(Message):
    """A worker reports its task done; its gradient went to the stores as ``gradient_chunk``s.

    ``compute_s`` is the step's compute time (emulated slowdown included) and ``transfer_s``
    the time the worker spent receiving its previous parameters.
    """

    worker_id: int
    token: str
    task_id: int
    version: int
    batch_size: int
    speed: float
    compute_s: float
    transfer_s: float
    loss: float


class GradientPushRequest(PushRequest, kw_only=True):
    """A push that carries its gradient, for runs whose coordinator is the only store and whose
    state is one chunk: ``push_token``, ``scale`` and ``gradient`` as in ``gradient_chunk``
    (offset 0, the whole state). Answered as ``push_request`` is; a task to train comes as a
    ``task_params_reply`` with the new parameters inside."""

    push_token: str
    scale: float
    gradient: np.ndarray


class DataRequest(Message):
    """A worker asks for the samples with the given training indices."""

    worker_id: int
    token: str
    indices: list[int]


class HeartbeatRequest(Message):
    """A worker says it is alive (sent from its own thread while it computes or waits)."""

    worker_id: int
    token: str


class StatusRequest(Message):
    """Anyone asks for the server's status."""


class LeaveRequest(Message):
    """A worker leaves gracefully."""

    worker_id: int
    token: str
    reason: str


# --- worker -> parameter store (the coordinator itself, or a shard) ---------------------------


class GradientChunk(Message):
    """One chunk of a task's gradient: ``gradient`` holds state elements ``[offset, offset + n)``
    in the run's wire format, multiplied by ``scale``; ``token`` is the task's push token.
    Answered with the same range of the next parameters (``params_chunk``) once the update is
    published, or with an error."""

    worker_id: int
    token: str
    task_id: int
    version: int
    offset: int
    scale: float
    gradient: np.ndarray


class PullRequest(Message):
    """Parameters ``[offset, offset + length)`` of version ``min_version`` or newer."""

    worker_id: int
    token: str
    min_version: int
    offset: int
    length: int


# --- replies -----------------------------------------------------------------------------------


class JoinReply(Message):
    """Membership granted: what to build, how the run is set up, and where parameters live.

    ``token`` goes with every request to the coordinator, ``store_token`` with every pull from a
    parameter store. ``shard_addresses[k]`` serves state elements ``shard_bounds[k]`` to
    ``shard_bounds[k + 1]``; an empty address means the coordinator itself. Samples travel in
    ``sample_dtype``; when ``norm_mean``/``norm_std`` are not empty the worker normalises them
    per band.
    """

    worker_id: int
    token: str
    store_token: str
    mode: str
    model: str
    in_channels: int
    num_classes: int
    input_size: int
    state_size: int
    num_params: int
    dataset_fingerprint: str
    seed: int
    server_id: str
    heartbeat_s: float
    dead_after_s: float
    wire_dtype: str
    chunk_elems: int
    shard_addresses: list[str]
    shard_bounds: list[int]
    sample_dtype: str
    norm_mean: list[float]
    norm_std: list[float]


class TaskReply(Message):
    """The next task: train on ``indices`` from parameters of version ``version`` (pulled from
    the stores), and prefetch ``prefetch`` meanwhile; or ``action == "stop"``, with the
    ``finish_reason`` and the ``failure`` that ended the run when one did (the worker then
    exits non-zero). The gradient's chunks carry ``push_token``, which only this worker got for
    this task."""

    action: str
    task_id: int
    push_token: str
    version: int
    epoch: int
    indices: list[int]
    prefetch: list[int]
    failure: str | None = None
    finish_reason: FinishReason | None = None


class TaskParamsReply(TaskReply, kw_only=True):
    """A ``task_reply`` to a ``gradient_push_request`` that also carries the published
    parameters: the whole state of ``params_version`` in the wire format, times ``scale``."""

    params_version: int
    scale: float
    params: np.ndarray


class ParamsChunk(Message):
    """Parameters ``[offset, offset + n)`` of ``version`` in the wire format, times ``scale``."""

    version: int
    offset: int
    scale: float
    params: np.ndarray


class DataReply(Message):
    """Samples ``x`` (n, C, H, W) in the join reply's ``sample_dtype`` and labels ``y`` (n,)
    int64, in request order."""

    x: np.ndarray
    y: np.ndarray


class StatusReply(Message):
    """The server's status as a JSON-like map."""

    status: dict


class HeartbeatReply(Message):
    """Acknowledges a heartbeat; a changed ``server_id`` means the server restarted, and a
    ``finish_reason`` that training has ended (the worker stops whatever it waits for), because
    of ``failure`` when one ended it."""

    server_id: str
    failure: str | None = None
    finish_reason: FinishReason | None = None


class LeaveReply(Message):
    """Acknowledges a leave."""


WORKER_REQUESTS = by_type(
    JoinRequest,
    TaskRequest,
    PushRequest,
    GradientPushRequest,
    DataRequest,
    HeartbeatRequest,
    StatusRequest,
    LeaveRequest,
)
STORE_REQUESTS = by_type(GradientChunk, PullRequest)
REPLIES = by_type(
    JoinReply,
    TaskReply,
    TaskParamsReply,
    ParamsChunk,
    DataReply,
    HeartbeatReply,
    StatusReply,
    LeaveReply,
)
