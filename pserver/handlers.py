"""The server's request handlers, one per request type (a mixin of ``ParameterServer``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from common.errors import ErrorCode, ProtocolError
from common.protocol.messages import (
    DataReply,
    DataRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    Message,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskRequest,
)
from pserver.membership import Waiter
from pserver.summary import status_of
from pserver.trainer import as_tensor

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger("pserver.server")


class RequestHandlers:
    """Validates each request against the run's state and answers it.

    A handler raises ``ProtocolError`` to reject a request; the transport turns that into an
    error reply. Nothing is changed before a request is fully validated.
    """

    async def dispatch(
        self: ParameterServer, identity: bytes, request_id: int, message: Message
    ) -> None:
        """Route a parsed request to its handler."""
        handler = {
            JoinRequest: self._on_join,
            TaskRequest: self._on_task_request,
            PushRequest: self._on_push,
            DataRequest: self._on_data,
            StatusRequest: self._on_status,
            HeartbeatRequest: self._on_heartbeat,
            LeaveRequest: self._on_leave,
        }[type(message)]
        await handler(identity, request_id, message)  # type: ignore[operator]

    async def _on_join(
        self: ParameterServer, identity: bytes, request_id: int, msg: JoinRequest
    ) -> None:
        if self._finished:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "training has ended")
        if msg.slowdown < 1 or msg.threads < 1 or not msg.name:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"join needs slowdown >= 1, threads >= 1 and a name; got "
                f"slowdown={msg.slowdown}, threads={msg.threads}, "
                f"name={msg.name!r}",
            )
        worker = self.roster.add(msg.name, msg.device, msg.slowdown, msg.threads, self.log.now())
        name = worker.name
        self.log.event("join", worker=name, device=msg.device, slowdown=msg.slowdown)
        log.info("worker %s joined (%s, slowdown %.1f)", name, msg.device, msg.slowdown)
        channels, height, _ = self.meta.shape
        self._reply(
            identity,
            request_id,
            JoinReply(
                worker_id=worker.worker_id,
                mode=self.config.mode,
                model=self.config.model,
                in_channels=channels,
                num_classes=self.meta.num_classes,
                input_size=height,
                state_size=self.trainer.state_size,
                dataset_fingerprint=self.meta.fingerprint,
                seed=self.config.seed,
                server_id=self.server_id,
                heartbeat_s=self.config.heartbeat_s,
                dead_after_s=self.config.dead_after_s,
            ),
        )

    async def _on_task_request(
        self: ParameterServer, identity: bytes, request_id: int, msg: TaskRequest
    ) -> None:
        worker = self._member(msg.worker_id)
        if not msg.speed > 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"speed must be > 0, got {msg.speed}")
        worker.speed = msg.speed
        worker.waiter = Waiter(identity, request_id)
        if not worker.ready:
            worker.ready = True
            self.log.event("ready", worker=worker.name, speed=round(msg.speed, 3))
            if self._started:
                self.policy.on_join(worker)
            elif len(self.active_workers()) >= self.config.workers:
                self._started = True
                if self.train_start is None:  # not when resuming
                    self.train_start = self.log.now()
                self.log.event(
                    "train_start", workers=len(self.active_workers()), version=self.trainer.version
                )
                self.policy.start()
                return
        self.release()

    async def _on_push(
        self: ParameterServer, identity: bytes, request_id: int, msg: PushRequest
    ) -> None:
        worker = self._member(msg.worker_id)
        if self._finished:
            worker.waiter = Waiter(identity, request_id)
            self._send_stop(worker)
            return
        task = worker.tasks[0] if worker.tasks else None
        if task is None or msg.task_id != task.task_id or self.policy.runnable(worker) is not task:
            # Also refuses a replay of a push that is being or has been applied.
            raise ProtocolError(
                ErrorCode.WRONG_TASK, f"task {msg.task_id} is not the task this worker is running"
            )
        if msg.batch_size != task.size:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"batch_size {msg.batch_size} differs from the task's {task.size}",
            )
        if msg.state.dtype != np.float32 or msg.state.shape != (self.trainer.state_size,):
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"state must be float32 of shape ({self.trainer.state_size},), "
                f"got {msg.state.dtype} {tuple(msg.state.shape)}",
            )
        if not 0 <= msg.version <= self.trainer.version:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"version {msg.version} was never served")
        if msg.speed > 0:
            worker.speed = msg.speed
        worker.waiter = Waiter(identity, request_id)
        task.pushed = True
        try:
            await self.policy.on_push(worker, task, msg, as_tensor(msg.state))
        except BaseException as exc:
            task.pushed = False
            if isinstance(exc, ProtocolError) and exc.code == ErrorCode.NON_FINITE:
                worker.non_finite += 1
            if worker.waiter is not None and worker.waiter.request_id == request_id:
                worker.waiter = None
            raise

    async def _on_data(
        self: ParameterServer, identity: bytes, request_id: int, msg: DataRequest
    ) -> None:
        self._member(msg.worker_id)
        indices = np.asarray(msg.indices, dtype=np.int64)
        if len(indices) and (
            indices.min() < 0
            or indices.max() >= len(self._train_mask)
            or not self._train_mask[indices].all()
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, "data_request may only name indices of the training split"
            )
        loop = asyncio.get_running_loop()
        x, y = await loop.run_in_executor(self._data_pool, self.reader.read, indices)
        self._reply(identity, request_id, DataReply(x=x, y=y))

    async def _on_status(
        self: ParameterServer, identity: bytes, request_id: int, msg: StatusRequest
    ) -> None:
        self._reply(identity, request_id, StatusReply(status=status_of(self)))

    async def _on_leave(
        self: ParameterServer, identity: bytes, request_id: int, msg: LeaveRequest
    ) -> None:
        worker = self._member(msg.worker_id)
        self._reply(identity, request_id, LeaveReply())
        self._drop(worker, f"left: {msg.reason}")

    async def _on_heartbeat(
        self: ParameterServer, identity: bytes, request_id: int, msg: HeartbeatRequest
    ) -> None:
        self._member(msg.worker_id)
        self._reply(identity, request_id, HeartbeatReply(server_id=self.server_id))
