"""async: each push is applied at once, its learning rate scaled by batch share and staleness."""

from __future__ import annotations

import torch

from common.errors import ErrorCode, ProtocolError
from common.protocol.messages import PushRequest
from common.training.planner import plan_batches
from pserver.membership import Task, WorkerInfo
from pserver.policies.base import ModePolicy, PolicyContext
from pserver.staleness import staleness_function

QUEUE_DEPTH = 2  # the task being computed and the one being prefetched


class AsyncPolicy(ModePolicy):
    """lr_eff = lr * (b_i / B) * f(tau); pushes older than ``--max-staleness`` are rejected."""

    name = "async"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.f = staleness_function(cfg.staleness, cfg.staleness_a, cfg.staleness_b)
        self.staleness_sum = 0
        self.staleness_max = 0
        self.applied = 0
        self.rejected = 0

    def start(self) -> None:
        for worker in self.ctx.active_workers():
            self._fill(worker)
        self.ctx.release()

    def on_join(self, worker: WorkerInfo) -> None:
        self._fill(worker)

    def _batch_for(self, worker: WorkerInfo) -> int:
        speeds = {w.worker_id: w.speed for w in self.ctx.active_workers()}
        return plan_batches(speeds, self.ctx.config.global_batch).get(worker.worker_id, 1)

    def _fill(self, worker: WorkerInfo) -> None:
        sampler = self.ctx.trainer.sampler
        while len(worker.tasks) < QUEUE_DEPTH and not self.ctx.finished and not sampler.exhausted:
            epoch, positions = sampler.take(self._batch_for(worker))
            if len(positions) == 0:
                break
            self.ctx.new_task(worker, epoch, positions)

    def runnable(self, worker: WorkerInfo) -> Task | None:
        return worker.tasks[0] if worker.tasks and not worker.tasks[0].pushed else None

    async def on_push(
        self, worker: WorkerInfo, task: Task, push: PushRequest, update: torch.Tensor
    ) -> None:
        cfg = self.ctx.config
        share = task.size / cfg.global_batch
        limit = cfg.max_staleness

        def lr_scale(tau: int) -> float:
            if limit is not None and tau > limit:
                raise ProtocolError(
                    ErrorCode.STALE,
                    f"push is {tau} versions old, more than --max-staleness "
                    f"{limit}; pull the current parameters and recompute",
                )
            return share * self.f(tau)

        try:
            tau = await self.ctx.trainer.apply(
                update, task.size, buffer_scale=share, based_on=push.version, lr_scale_for=lr_scale
            )
        except ProtocolError as exc:
            if exc.code == ErrorCode.STALE:
                self.rejected += 1
                worker.rejected += 1
            raise
        self.applied += 1
        self.staleness_sum += tau
        self.staleness_max = max(self.staleness_max, tau)
        if worker.tasks and worker.tasks[0] is task:
            worker.tasks.popleft()
        self.ctx.log.event(
            "push",
            worker=worker.name,
            batch=task.size,
            epoch=task.epoch,
            speed=round(worker.speed, 3),
            staleness=tau,
            version=self.ctx.trainer.version,
        )
        self.ctx.account([(worker, task)])
        if worker.active:
            self._fill(worker)
        self.ctx.release()

    async def on_leave(self, worker: WorkerInfo) -> None:
        """Give the worker's queued samples back; a push being applied still counts."""
        for task in worker.tasks:
            if not task.pushed:
                self.ctx.trainer.sampler.give_back(task.epoch, task.positions)
        worker.tasks.clear()
        for other in self.ctx.active_workers():
            self._fill(other)
        self.ctx.release()

    def staleness(self) -> dict[str, float] | None:
        """Mean and max staleness of applied pushes."""
        if not self.applied:
            return {"mean": 0.0, "max": 0}
        return {"mean": self.staleness_sum / self.applied, "max": self.staleness_max}

    def state(self) -> dict[str, object]:
        return {
            "applied": self.applied,
            "rejected": self.rejected,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
        }

    def restore(self, state: dict[str, object]) -> None:
        self.applied = int(state["applied"])  # type: ignore[call-overload]
        self.rejected = int(state["rejected"])  # type: ignore[call-overload]
        self.staleness_sum = int(state["staleness_sum"])  # type: ignore[call-overload]
        self.staleness_max = int(state["staleness_max"])  # type: ignore[call-overload]

    def summary(self) -> dict[str, object]:
        return {"rejected_stale": self.rejected}
