"""The coordinator's request handlers: one method per request type.

A handler validates everything before it changes anything, and raises ``ProtocolError`` to
reject a request (the endpoint turns it into an error reply). Pushes go to the push path
(``pserver.pushes``); a task changes hands only once its push is accepted.
"""

from __future__ import annotations

import asyncio
import functools
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
from common.training.runlog import RunLog
from pserver.config import ServerConfig
from pserver.desk import TaskDesk
from pserver.errorlog import RateLimitedLog
from pserver.membership import MAX_NAME, Roster, Waiter, WorkerInfo
from pserver.pushes import Pushes, check_speed
from pserver.runstate import RunState
from pserver.store.service import StoreService
from pserver.store.shards import ShardRegistry
from pserver.store.stores import RemoteStores
from pserver.summary import StatusView
from pserver.transport import Endpoint, Request

log = logging.getLogger(__name__)

MAX_DATA_BYTES = 64 << 20  # per data request
MAX_IN_FLIGHT_BYTES = 256 << 20  # data for one worker read or queued, not yet on the wire
STATUS_CACHE_S = 0.25


class Handlers:
    """Answers every request the coordinator takes.

    Args:
        config: the server configuration.
        run: the run's record and lifecycle.
        roster: the workers.
        log: the run log.
        endpoint: where replies go.
        reader: the dataset (training samples for data requests; its normalisation).
        stores: the parameter stores (the coordinator's own, or the shard links).
        tokens: issues worker tokens.
        store_tokens: issues the tokens workers show the stores.
        join_terms: the run's fixed part of every join reply (model, sizes, wire format, ...).
        status: the live status.
        shards: registers shards (None: the run has none).
        desk: queues tasks and answers waiting workers.
        pushes: the push path.
        version: the published version.
        drop_worker: removes a worker that left (``drop_worker(worker, reason)``).
    """

    def __init__(
        self,
        config: ServerConfig,
        run: RunState,
        roster: Roster,
        log: RunLog,
        endpoint: Endpoint,
        reader: DatasetReader,
        stores: StoreService | RemoteStores,
        tokens: TokenBook,
        store_tokens: TokenBook,
        join_terms: dict[str, Any],
        status: StatusView,
        shards: ShardRegistry | None,
        desk: TaskDesk,
        pushes: Pushes,
        version: Callable[[], int],
        drop_worker: Callable[[WorkerInfo, str], None],
    ) -> None:
        self.config, self.run, self.roster, self.log = config, run, roster, log
        self.endpoint, self.reader, self.stores = endpoint, reader, stores
        self.tokens, self.store_tokens, self.join_terms = tokens, store_tokens, join_terms
        self.status_view, self.shards, self.desk, self.pushes = status, shards, desk, pushes
        self.version, self.drop_worker = version, drop_worker
        self._status: tuple[float, dict] | None = None
        self._warnings = RateLimitedLog(logging.getLogger(__name__))
        self._reading: dict[int, int] = {}  # worker id -> bytes of data replies being read
        self._sockets: dict[int, set[bytes]] = {}  # worker id -> sockets with queued data
        train_mask = np.zeros(reader.meta.num_samples, dtype=bool)
        train_mask[reader.train_indices] = True
        self._train_mask = train_mask
        self._sample_bytes = int(np.prod(reader.meta.shape)) * reader.codec.itemsize + 8

    async def dispatch(self, request: Request, message: Message) -> None:
        """Route a parsed request to its handler."""
        await self._handlers[type(message)](request, message)

    @functools.cached_property
    def _handlers(self) -> dict[type[Message], Callable[[Request, Any], Awaitable[None]]]:
        return {
            JoinRequest: self.join,
            TaskRequest: self.task,
            PushRequest: self.push,
            GradientPushRequest: self.gradient_push,
            DataRequest: self.data,
            StatusRequest: self.status,
            HeartbeatRequest: self.heartbeat,
            LeaveRequest: self.leave,
            GradientChunk: self.store_chunk,
            PullRequest: self.store_pull,
            ShardHello: self.shard_hello,
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
        if isinstance(stores, RemoteStores) and not stores.ready.is_set():
            try:
                await asyncio.wait_for(stores.ready.wait(), self.config.shard_timeout_s)
            except TimeoutError:
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"waiting for {stores.expected - len(stores.links)} of "
                    f"{stores.expected} parameter shards to register; try again",
                ) from None
        worker = self.roster.add(
            msg.name,
            msg.device,
            msg.slowdown,
            msg.threads,
            self.log.now(),
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
                token=self.tokens.token(worker.worker_id),
                store_token=self.store_tokens.token(worker.worker_id),
                shard_addresses=list(stores.addresses),
                shard_bounds=list(stores.bounds),
                **self.join_terms,
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
            server_id=self.join_terms["server_id"],
            failure=self.run.failed,
            finish_reason=self.run.reason,
        )
        self.endpoint.reply(request.identity, request.request_id, reply)

    async def leave(self, request: Request, msg: LeaveRequest) -> None:
        worker = self.roster.member(msg.worker_id, msg.token, request.user_id)
        self.endpoint.reply(request.identity, request.request_id, LeaveReply())
        self.drop_worker(worker, f"left: {escape_control(msg.reason[:200])}")

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
        self.log.event("train_start", workers=len(self.roster.ready()), version=self.version())

    async def push(self, request: Request, msg: PushRequest) -> None:
        await self.pushes.push(request, msg)

    async def gradient_push(self, request: Request, msg: GradientPushRequest) -> None:
        """A push with its gradient inside: staged in the coordinator's own store, then the
        push path as for ``push_request``."""
        stores = self._local_stores("gradient_push_request")
        await stores.on_gradient_push(msg)
        try:
            await self.pushes.push(request, msg)
        except ProtocolError as exc:  # refused: the gradient it brought goes with it
            await stores.drop([msg.task_id], exc.code, str(exc))
            raise

    # --- data -------------------------------------------------------------------------------

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

    # --- parameter store (--shards 1) and shard registration --------------------------------

    async def store_chunk(self, request: Request, msg: GradientChunk) -> None:
        stores = self._local_stores("gradient_chunk")
        await stores.on_gradient_chunk(request.identity, request.request_id, msg)

    async def store_pull(self, request: Request, msg: PullRequest) -> None:
        stores = self._local_stores("pull_request")
        await stores.on_pull(request.identity, request.request_id, msg)

    def _local_stores(self, what: str) -> StoreService:
        stores = self.stores
        if not isinstance(stores, StoreService):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"{what}: this run's parameters live on its shards"
            )
        return stores

    async def shard_hello(self, request: Request, msg: ShardHello) -> None:
        if self.shards is None:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, "this server was not started with --shards K > 1"
            )
        await self.shards.register(request, msg)


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
