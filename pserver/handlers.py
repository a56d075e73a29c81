"""The coordinator's request handlers: one per request type, and the dispatch over them.

A handler validates everything before it changes anything, and raises ``ProtocolError`` to
reject a request (the endpoint turns it into an error reply). Pushes go to the push path
(``pserver.pushes``); a task changes hands only once its push is accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from common.config import escape_control, name_problem
from common.data.dataset import DatasetReader
from common.errors import ErrorCode, ProtocolError
from common.protocol.base import Message
from common.protocol.messages import (
    DataReply,
    DataRequest,
    GradientChunk,
    GradientPushRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    PullRequest,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskRequest,
)
from common.protocol.shard_messages import ShardHello
from common.protocol.tokens import TokenBook
from common.training.perfmodel import MAX_CALIBRATION
from pserver.context import RunBooks, RunContext
from pserver.departures import Departures
from pserver.desk import TaskDesk
from pserver.errorlog import RateLimitedLog
from pserver.membership import MAX_NAME, Roster, Waiter
from pserver.pushes import Pushes, check_speed
from pserver.store.shards import ShardRegistry
from pserver.store.stores import ParameterStores
from pserver.summary import StatusView
from pserver.transport import Endpoint, Request

log = logging.getLogger(__name__)

MAX_DATA_BYTES = 64 << 20  # per data request
MAX_IN_FLIGHT_BYTES = 256 << 20  # data for one worker read or queued, not yet on the wire
STATUS_CACHE_S = 0.25


Handler = Callable[[Request, Any], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class Admission:
    """What a join reply hands out.

    Attributes:
        tokens: issues worker tokens.
        store_tokens: issues the tokens workers show the stores.
        terms: the run's fixed part of every join reply (model, sizes, wire format, ...).
        stores: the parameter stores (their addresses and ranges; a join waits until they
            can serve).
    """

    tokens: TokenBook
    store_tokens: TokenBook
    terms: dict[str, Any]
    stores: ParameterStores


def store_routes(
    stores: ParameterStores, pushes: Pushes, shards: ShardRegistry | None
) -> dict[type[Message], Handler]:
    """The handlers of pushes, of gradient chunks and pulls sent to the coordinator, and of
    shard hellos.

    Args:
        stores: the parameter stores.
        pushes: the push path.
        shards: registers shards (None: the run has none).

    Returns:
        One handler per request type.
    """

    async def chunk(request: Request, msg: GradientChunk) -> None:
        await stores.on_gradient_chunk(request.identity, request.request_id, msg)

    async def pull(request: Request, msg: PullRequest) -> None:
        await stores.on_pull(request.identity, request.request_id, msg)

    async def gradient_push(request: Request, msg: GradientPushRequest) -> None:
        """Staged in the coordinator's own store, then the push path as for ``push_request``
        (a gradient from no member is not staged)."""
        pushes.roster.member(msg.worker_id, msg.token, request.user_id)
        await stores.on_gradient_push(msg)
        try:
            await pushes.push(request, msg)
        except ProtocolError as exc:  # refused: the gradient it brought goes with it
            await stores.drop([msg.task_id], exc.code, str(exc))
            raise

    async def shard_hello(request: Request, msg: ShardHello) -> None:
        if shards is None:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, "this server was not started with --shards K > 1"
            )
        await shards.register(request, msg)

    return {
        PushRequest: pushes.push,
        GradientPushRequest: gradient_push,
        GradientChunk: chunk,
        PullRequest: pull,
        ShardHello: shard_hello,
    }


class Handlers:
    """Answers the members' requests: join, task, heartbeat, status and leave.

    Args:
        context: the run (its configuration, record and log).
        books: the roster and the published version.
        endpoint: where replies go.
        admission: what a join reply hands out.
        status: the live status.
        desk: queues tasks and answers waiting workers.
        departures: removes a worker that left.
    """

    def __init__(
        self,
        context: RunContext,
        books: RunBooks,
        *,
        endpoint: Endpoint,
        admission: Admission,
        status: StatusView,
        desk: TaskDesk,
        departures: Departures,
    ) -> None:
        self.config, self.run, self.log = context.config, context.run, context.log
        self.roster, self.updater, self.endpoint = books.roster, books.updater, endpoint
        self.admission, self.stores = admission, admission.stores
        self.status_view, self.desk, self.departures = status, desk, departures
        self._status: tuple[float, dict] | None = None
        self._warnings = RateLimitedLog(logging.getLogger(__name__))

    @property
    def routes(self) -> dict[type[Message], Handler]:
        """One handler per request type this class answers."""
        return {
            JoinRequest: self.join,
            TaskRequest: self.task,
            StatusRequest: self.status,
            HeartbeatRequest: self.heartbeat,
            LeaveRequest: self.leave,
        }

    # --- membership -------------------------------------------------------------------------

    async def join(self, request: Request, msg: JoinRequest) -> None:
        if self.run.finished:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "training has ended")
        if not (1 <= msg.slowdown <= 1e6) or not (1 <= msg.threads <= 4096):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"join needs 1 <= slowdown <= 1e6 and 1 <= threads <= 4096; got "
                f"slowdown={msg.slowdown}, threads={msg.threads}",
            )
        for value, what in (
            (msg.name, "name"),
            (msg.device, "device"),
            (msg.torch_version, "torch_version"),
        ):
            problem = "" if value is None else name_problem(value, what)
            if problem:  # these reach log lines and reports: no control or markup characters
                raise ProtocolError(ErrorCode.BAD_FIELD, problem)
        stores = self.stores
        await stores.wait_ready()
        worker = self.roster.add(
            msg.name,
            msg.device,
            msg.slowdown,
            msg.threads,
            request.user_id,
        )
        self.log.event(
            "join",
            worker=worker.name,
            device=worker.device,
            slowdown=msg.slowdown,
            torch=msg.torch_version,
            host=None if msg.host is None else msg.host[:MAX_NAME],
        )
        if msg.torch_version is not None and msg.torch_version != torch.__version__:
            self._warnings.warning(
                "torch",
                "worker %s runs torch %s, this server %s: training works while both build the "
                "same parameter layout (the worker checks it), but results may differ in the "
                "last digits; install the same torch on every node to rule that out",
                worker.name,
                msg.torch_version,
                torch.__version__,
            )
        log.info("worker %s joined (%s, slowdown %.1f)", worker.name, worker.device, msg.slowdown)
        self.endpoint.reply(
            request.identity,
            request.request_id,
            JoinReply(
                worker_id=worker.worker_id,
                token=self.admission.tokens.token(worker.worker_id),
                store_token=self.admission.store_tokens.token(worker.worker_id),
                shard_addresses=list(stores.addresses),
                shard_bounds=list(stores.bounds),
                **self.admission.terms,
            ),
        )

    async def heartbeat(self, request: Request, msg: HeartbeatRequest) -> None:
        try:
            self.roster.member(msg.worker_id, msg.token, request.user_id)
        except ProtocolError:
            # A member told to stop leaves the roster at once, and its heartbeat may come
            # before it has read the stop reply: after training, its token learns that.
            if not self.run.finished:
                raise
            self.roster.tokens.check(msg.worker_id, msg.token)
        reply = HeartbeatReply(
            server_id=self.admission.terms["server_id"],
            failure=self.run.failed,
            finish_reason=self.run.reason,
        )
        self.endpoint.reply(request.identity, request.request_id, reply)

    async def leave(self, request: Request, msg: LeaveRequest) -> None:
        worker = self.roster.member(msg.worker_id, msg.token, request.user_id)
        self.endpoint.reply(request.identity, request.request_id, LeaveReply())
        self.departures.drop(worker, f"left: {escape_control(msg.reason[:200])}")

    async def status(self, request: Request, msg: StatusRequest) -> None:
        now = time.monotonic()
        if self._status is None or now - self._status[0] > STATUS_CACHE_S:
            self._status = (now, self.status_view.status())
        reply = StatusReply(status=self._status[1])
        self.endpoint.reply(request.identity, request.request_id, reply)

    # --- training ---------------------------------------------------------------------------

    async def task(self, request: Request, msg: TaskRequest) -> None:
        worker = self.roster.member(msg.worker_id, msg.token, request.user_id)
        check_speed(msg.speed)
        _check_calibration(msg)
        first = self.roster.calibrated(
            worker, msg.speed, msg.calibration_batches, msg.calibration_s
        )
        self.roster.wait(worker, Waiter(request.identity, request.request_id))
        if first:
            self.log.event("ready", worker=worker.name, speed=round(msg.speed, 3))
            if not self.run.started and len(self.roster.ready()) >= self.config.workers:
                self._start_training()
        self.desk.plan()
        self.desk.dispatch()

    def _start_training(self) -> None:
        """Enough workers are ready: training starts."""
        self.run.start_training(self.log.now())
        self.log.event(
            "train_start", workers=len(self.roster.ready()), version=self.updater.version
        )


class DataRequests:
    """Answers data requests with training samples, bounded per worker.

    Args:
        reader: the dataset.
        roster: the workers (who may ask).
        endpoint: where replies go (and how much of each socket's replies is still queued).
    """

    def __init__(self, reader: DatasetReader, roster: Roster, *, endpoint: Endpoint) -> None:
        self.reader, self.roster, self.endpoint = reader, roster, endpoint
        self._reading: dict[int, int] = {}  # worker id -> bytes of data replies being read
        self._sockets: dict[int, set[bytes]] = {}  # worker id -> sockets with queued data
        train_mask = np.zeros(reader.meta.num_samples, dtype=bool)
        train_mask[reader.train_indices] = True
        self._train_mask = train_mask
        self._sample_bytes = int(np.prod(reader.meta.shape)) * reader.codec.itemsize + 8

    async def data(self, request: Request, msg: DataRequest) -> None:
        worker = self.roster.member(msg.worker_id, msg.token, request.user_id).worker_id
        indices = np.asarray(msg.indices, dtype=np.int64)
        nbytes = len(indices) * self._sample_bytes
        if nbytes > MAX_DATA_BYTES:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"{len(indices)} samples ({nbytes >> 20} MiB) exceed {MAX_DATA_BYTES >> 20} MiB "
                "per data request",
            )
        if len(indices) and (
            indices.min() < 0
            or indices.max() >= len(self._train_mask)
            or not self._train_mask[indices].all()
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, "data_request may only name indices of the training split"
            )
        if self._unread(worker) + nbytes > MAX_IN_FLIGHT_BYTES:
            raise ProtocolError(
                ErrorCode.BUSY, "too much data for this worker is still unread; read it first"
            )
        self._reading[worker] = self._reading.get(worker, 0) + nbytes
        try:
            loop = asyncio.get_running_loop()
            x, y = await loop.run_in_executor(None, self.reader.read_stored, indices)
            self.endpoint.reply(request.identity, request.request_id, DataReply(x=x, y=y))
            self._sockets.setdefault(worker, set()).add(request.identity)
        finally:
            self._reading[worker] -= nbytes
            if not self._reading[worker]:
                del self._reading[worker]

    def _unread(self, worker: int) -> int:
        """Bytes a worker asked for and has not read: data replies being read from the
        dataset and every large reply queued to any socket it got data on (a worker with
        nothing queued is forgotten)."""
        queued: dict[int, int] = {}
        for member in list(self._sockets) if len(self._sockets) > 64 else [worker]:
            sockets = self._sockets.get(member, set())
            queued[member] = sum(self.endpoint.in_flight(identity) for identity in sockets)
            if not queued[member]:
                self._sockets.pop(member, None)
        return queued.get(worker, 0) + self._reading.get(worker, 0)


def _check_calibration(msg: TaskRequest) -> None:
    batches, seconds = msg.calibration_batches, msg.calibration_s
    if (batches is None) != (seconds is None) or len(batches or []) != len(seconds or []):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, "calibration_batches and calibration_s must pair up"
        )
    if len(batches or []) > MAX_CALIBRATION:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"at most {MAX_CALIBRATION} calibration pairs, got {len(batches or [])}",
        )
