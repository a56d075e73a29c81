"""The coordinator's request handlers: one method per request type, composed with the server.

A handler validates everything before it changes anything, and raises ``ProtocolError`` to
reject a request (the endpoint turns it into an error reply). The push path is handled here
in one place: a task changes hands only once its push is accepted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.errors import ErrorCode, ProtocolError
from common.protocol.base import Message
from common.protocol.messages import (
    OPTIONAL_REPLY_FIELDS,
    DataReply,
    DataRequest,
    GradientChunk,
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
from common.training.perfmodel import MAX_CALIBRATION
from pserver.membership import MAX_NAME, Task, Waiter, WorkerInfo
from pserver.shards import register_shard
from pserver.store.stores import LocalStores
from pserver.summary import status_of
from pserver.transport import Request

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger(__name__)

MIN_SPEED, MAX_SPEED = 1e-6, 1e9  # samples/s a worker may report
MAX_DATA_BYTES = 64 << 20  # per data request
MAX_IN_FLIGHT_BYTES = 256 << 20  # replies to one peer not yet on the wire
STATUS_CACHE_S = 0.25


class Handlers:
    """Answers every request the coordinator takes.

    Args:
        server: the server whose state the handlers read and change through its methods.
    """

    def __init__(self, server: ParameterServer) -> None:
        self.server = server
        self._status: tuple[float, dict] | None = None
        train_mask = np.zeros(server.meta.num_samples, dtype=bool)
        train_mask[server.reader.train_indices] = True
        self._train_mask = train_mask
        self._sample_bytes = int(np.prod(server.meta.shape)) * server.reader.codec.itemsize + 8

    async def dispatch(self, request: Request, message: Message) -> None:
        """Route a parsed request to its handler."""
        handler = {
            JoinRequest: self.join,
            TaskRequest: self.task,
            PushRequest: self.push,
            DataRequest: self.data,
            StatusRequest: self.status,
            HeartbeatRequest: self.heartbeat,
            LeaveRequest: self.leave,
            GradientChunk: self.store_chunk,
            PullRequest: self.store_pull,
            ShardHello: self.shard_hello,
        }[type(message)]
        await handler(request, message)  # type: ignore[operator]

    # --- membership -------------------------------------------------------------------------

    async def join(self, request: Request, msg: JoinRequest) -> None:
        ps = self.server
        if ps.finished:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "training has ended")
        if not (1 <= msg.slowdown <= 1e6) or not (1 <= msg.threads <= 4096) or not msg.name:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"join needs 1 <= slowdown <= 1e6, 1 <= threads <= 4096 and a name; got "
                f"slowdown={msg.slowdown}, threads={msg.threads}, name={msg.name!r:.80}",
            )
        stores = ps.stores
        if not isinstance(stores, LocalStores) and not stores.ready.is_set():
            try:
                await asyncio.wait_for(stores.ready.wait(), ps.config.shard_timeout_s)
            except TimeoutError:
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"waiting for {stores.expected - len(stores.links)} of "
                    f"{stores.expected} parameter shards to register; try again",
                ) from None
        worker = ps.roster.add(
            msg.name, msg.device, msg.slowdown, msg.threads, ps.log.now(), request.user_id
        )
        worker.reply_fields = OPTIONAL_REPLY_FIELDS.intersection(msg.reply_fields or ())
        ps.log.event(
            "join",
            worker=worker.name,
            device=worker.device,
            slowdown=msg.slowdown,
            torch=msg.torch_version,
            host=None if msg.host is None else msg.host[:MAX_NAME],
        )
        if msg.torch_version is not None and msg.torch_version != torch.__version__:
            log.warning(
                "worker %s runs torch %s, this server %s: training works while both build the "
                "same parameter layout (the worker checks it), but results may differ in the "
                "last digits; install the same torch on every node to rule that out",
                worker.name,
                msg.torch_version[:40],
                torch.__version__,
            )
        log.info("worker %s joined (%s, slowdown %.1f)", worker.name, worker.device, msg.slowdown)
        channels, height, _ = ps.meta.shape
        mean, std = ps.reader.codec.wire_stats()
        ps.endpoint.reply(
            request.identity,
            request.request_id,
            JoinReply(
                worker_id=worker.worker_id,
                token=ps.tokens.token(worker.worker_id),
                store_token=ps.store_tokens.token(worker.worker_id),
                mode=ps.config.mode,
                model=ps.config.model,
                in_channels=channels,
                num_classes=ps.meta.num_classes,
                input_size=height,
                state_size=ps.state_size,
                num_params=ps.num_params,
                dataset_fingerprint=ps.meta.fingerprint,
                seed=ps.config.seed,
                server_id=ps.server_id,
                heartbeat_s=ps.config.heartbeat_s,
                dead_after_s=ps.config.dead_after_s,
                wire_dtype=ps.config.wire_dtype,
                chunk_elems=ps.chunk_elems,
                shard_addresses=list(stores.addresses),
                shard_bounds=list(stores.bounds),
                sample_dtype=ps.reader.codec.dtype,
                norm_mean=mean,
                norm_std=std,
            ),
        )

    async def heartbeat(self, request: Request, msg: HeartbeatRequest) -> None:
        worker = self.server.roster.member(msg.worker_id, msg.token, request.user_id)
        reply = HeartbeatReply(
            server_id=self.server.server_id,
            finished=self.server.finished,
            failure=self.server.failure,
            finish_reason=worker.finish_reason(self.server.run.reply_reason),
        )
        self.server.endpoint.reply(request.identity, request.request_id, reply)

    async def leave(self, request: Request, msg: LeaveRequest) -> None:
        worker = self.server.roster.member(msg.worker_id, msg.token, request.user_id)
        self.server.endpoint.reply(request.identity, request.request_id, LeaveReply())
        self.server.drop_worker(worker, f"left: {msg.reason}")

    async def status(self, request: Request, msg: StatusRequest) -> None:
        now = time.monotonic()
        if self._status is None or now - self._status[0] > STATUS_CACHE_S:
            self._status = (now, status_of(self.server))
        reply = StatusReply(status=self._status[1])
        self.server.endpoint.reply(request.identity, request.request_id, reply)

    # --- training ---------------------------------------------------------------------------

    async def task(self, request: Request, msg: TaskRequest) -> None:
        ps = self.server
        worker = ps.roster.member(msg.worker_id, msg.token, request.user_id)
        _check_speed(msg.speed)
        _check_calibration(msg)
        worker.speed = msg.speed
        if msg.calibration_batches:
            worker.perf.seed(msg.calibration_batches, msg.calibration_s or [])
        worker.waiter = Waiter(request.identity, request.request_id)
        if not worker.ready:
            worker.ready = True
            ps.log.event("ready", worker=worker.name, speed=round(msg.speed, 3))
            if not ps.started and len(ps.roster.ready()) >= ps.config.workers:
                ps.start_training()
        ps.plan()
        ps.release()

    async def push(self, request: Request, msg: PushRequest) -> None:
        """The one path of a push: check it, wait for its gradient to be complete in the
        stores, check the gradient, then hand it to the policy (which may close an update)."""
        ps = self.server
        worker = ps.roster.member(msg.worker_id, msg.token, request.user_id)
        if ps.finished:
            worker.waiter = Waiter(request.identity, request.request_id)
            ps.stop_worker(worker)
            return
        if msg.task_id == worker.pushing:
            raise ProtocolError(ErrorCode.WRONG_TASK, f"task {msg.task_id} is being pushed already")
        try:
            task = self._pushed_task(worker, msg)
        except ProtocolError as exc:
            if any(t.task_id == msg.task_id for t in worker.tasks):
                # Its chunks may be in: drop them, so that a corrected push can resend them.
                await ps.stores.drop([msg.task_id], exc.code, str(exc))
            raise
        worker.pushing = task.task_id
        try:
            report = await ps.stores.staged(
                task.task_id, worker.worker_id, ps.config.stage_timeout_s
            )
            if not worker.active or not worker.tasks or worker.tasks[0] is not task:
                raise ProtocolError(
                    ErrorCode.WRONG_TASK, "the task was withdrawn (the worker left)"
                )
            if ps.finished:  # training ended while the gradient arrived: just stop
                worker.pushing = None
                await ps.stores.drop([task.task_id], ErrorCode.SHUTTING_DOWN, "training ended")
                worker.waiter = Waiter(request.identity, request.request_id)
                ps.stop_worker(worker)
                return
            clip = ps.guard.check(report)
        except ProtocolError as exc:
            worker.pushing = None
            if exc.code == ErrorCode.NON_FINITE:
                worker.non_finite += 1
            elif exc.code == ErrorCode.REFUSED:
                worker.refused += 1
            await ps.stores.drop([task.task_id], exc.code, str(exc))
            raise
        except BaseException:
            worker.pushing = None
            raise
        # Accepted: the push counts from here on, even if the worker leaves.
        worker.tasks.popleft()
        worker.speed = msg.speed
        worker.compute_s, worker.transfer_s = msg.compute_s, msg.transfer_s
        worker.perf.add_compute(task.size, msg.compute_s)
        if not ps.config.is_sync and worker.released_at:  # sync: measured when rounds close
            worker.perf.add_transfer(time.monotonic() - worker.released_at - msg.compute_s)
        worker.waiter = Waiter(request.identity, request.request_id)
        if clip != 1.0:
            ps.clip[task.task_id] = clip
        update = ps.policy.accept(worker, task, msg)
        if ps.config.is_sync:
            worker.pushing = None
        if update is not None:
            await ps.run_update(update)
        else:
            ps.plan()
            ps.release()

    def _pushed_task(self, worker: WorkerInfo, msg: PushRequest) -> Task:
        """The task a push answers, after checking every field of the push."""
        ps = self.server
        task = worker.tasks[0] if worker.tasks else None
        if (
            task is None
            or msg.task_id != task.task_id
            or worker.pushing is not None
            or ps.policy.runnable(worker) is not task
        ):
            raise ProtocolError(
                ErrorCode.WRONG_TASK, f"task {msg.task_id} is not the task this worker is running"
            )
        if msg.batch_size != task.size:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"batch_size {msg.batch_size} differs from the task's {task.size}",
            )
        if not 0 <= msg.version <= ps.updater.version:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"version {msg.version} was never served")
        _check_speed(msg.speed)
        for name in ("compute_s", "transfer_s"):
            if not 0 <= getattr(msg, name) < 1e6:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} {getattr(msg, name)} is absurd")
        return task

    # --- data -------------------------------------------------------------------------------

    async def data(self, request: Request, msg: DataRequest) -> None:
        ps = self.server
        ps.roster.member(msg.worker_id, msg.token, request.user_id)
        indices = np.asarray(msg.indices, dtype=np.int64)
        nbytes = len(indices) * self._sample_bytes
        if nbytes > MAX_DATA_BYTES:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"{len(indices)} samples ({nbytes >> 20} MiB) exceed {MAX_DATA_BYTES >> 20} MiB "
                "per data request",
            )
        if ps.endpoint.in_flight(request.identity) + nbytes > MAX_IN_FLIGHT_BYTES:
            raise ProtocolError(
                ErrorCode.BUSY, "too much data for this connection is still unread; read it first"
            )
        if len(indices) and (
            indices.min() < 0
            or indices.max() >= len(self._train_mask)
            or not self._train_mask[indices].all()
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, "data_request may only name indices of the training split"
            )
        loop = asyncio.get_running_loop()
        x, y = await loop.run_in_executor(None, ps.reader.read_stored, indices)
        ps.endpoint.reply(request.identity, request.request_id, DataReply(x=x, y=y))

    # --- parameter store (--shards 1) and shard registration --------------------------------

    async def store_chunk(self, request: Request, msg: GradientChunk) -> None:
        stores = self._local_stores("gradient_chunk")
        await stores.service.on_gradient_chunk(request.identity, request.request_id, msg)

    async def store_pull(self, request: Request, msg: PullRequest) -> None:
        stores = self._local_stores("pull_request")
        await stores.service.on_pull(request.identity, request.request_id, msg)

    def _local_stores(self, what: str) -> LocalStores:
        stores = self.server.stores
        if not isinstance(stores, LocalStores):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"{what}: this run's parameters live on its shards"
            )
        return stores

    async def shard_hello(self, request: Request, msg: ShardHello) -> None:
        await register_shard(self.server, request, msg)


def _check_speed(speed: float) -> None:
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"speed must be in [{MIN_SPEED:g}, {MAX_SPEED:g}], got {speed}"
        )


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
