"""Synchronous rounds: every worker gets a share of a global batch; the round closes when all
shares are in, and their weighted sum is applied as one step."""

from __future__ import annotations

import abc
import collections
import dataclasses
import time

import numpy as np
import torch

from common.protocol.messages import PushRequest
from pserver.membership import Task, WorkerInfo
from pserver.policies.base import ModePolicy, PolicyContext


@dataclasses.dataclass
class Round:
    """One synchronous round: the tasks, the pushes received so far and their weighted sum."""

    round_id: int
    epoch: int
    tasks: dict[int, Task]
    weights: dict[int, float]
    received: dict[int, tuple[WorkerInfo, Task]] = dataclasses.field(default_factory=dict)
    total: torch.Tensor | None = None
    weight_in: float = 0.0
    started: float = 0.0
    closing: bool = False

    @property
    def samples(self) -> int:
        """The round's global batch."""
        return sum(t.size for t in self.tasks.values())


class SyncRounds(ModePolicy):
    """Shared machinery of the synchronous modes; subclasses choose sizes and weights.

    The next round is planned when the current one is released, so workers can prefetch its
    data while they compute; it uses the speeds known at that moment.
    """

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.rounds: collections.deque[Round] = collections.deque()
        self.next_round_id = 1
        self.round_times: list[float] = []

    @abc.abstractmethod
    def batch_sizes(self, workers: list[WorkerInfo], total: int) -> dict[int, int]:
        """worker id -> local batch, summing to ``total``."""

    @abc.abstractmethod
    def weights(self, sizes: dict[int, int]) -> dict[int, float]:
        """worker id -> weight of its mean gradient; the weights sum to 1."""

    def start(self) -> None:
        self._plan()
        self._plan()
        self._begin_current()

    def on_join(self, worker: WorkerInfo) -> None:
        """A late joiner is planned into the next round that is not yet planned; if training
        had stalled for lack of workers, rounds start again."""
        if not self.rounds:
            self.start()

    def _plan(self) -> None:
        """Append a round over the active workers to the queue, unless training is over."""
        ctx = self.ctx
        sampler = ctx.trainer.sampler
        workers = ctx.active_workers()
        if ctx.finished or not workers or sampler.exhausted:
            return
        total = min(ctx.config.global_batch, sampler.remaining_in_epoch())
        sizes = self.batch_sizes(workers, total)
        epoch, positions = sampler.take(total)
        tasks, offset = {}, 0
        for worker in workers:
            n = sizes.get(worker.worker_id, 0)
            if n:
                tasks[worker.worker_id] = ctx.new_task(
                    worker, epoch, positions[offset : offset + n], self.next_round_id
                )
                offset += n
        self.rounds.append(Round(self.next_round_id, epoch, tasks, self.weights(sizes)))
        self.next_round_id += 1

    def _begin_current(self) -> None:
        if self.rounds:
            self.rounds[0].started = time.monotonic()
        self.ctx.release()

    def runnable(self, worker: WorkerInfo) -> Task | None:
        if not self.rounds or not worker.tasks:
            return None
        current = self.rounds[0]
        task = current.tasks.get(worker.worker_id)
        if task is not None and task is worker.tasks[0] and not task.pushed:
            return task
        return None

    async def on_push(
        self, worker: WorkerInfo, task: Task, push: PushRequest, update: torch.Tensor
    ) -> None:
        current = self.rounds[0]
        wid = worker.worker_id
        weight = current.weights[wid]
        if current.total is None:
            current.total = torch.zeros(update.numel())
        await self.ctx.trainer.accumulate(current.total, update, weight)
        current.received[wid] = (worker, task)  # counts even if the worker leaves meanwhile
        current.weight_in += weight
        if worker.tasks and worker.tasks[0] is task:
            worker.tasks.popleft()
        await self._maybe_close(current)

    async def on_leave(self, worker: WorkerInfo) -> None:
        """Drop the worker's unfinished tasks; their samples go back to the sampler. A task
        whose push already arrived (or is being added) still counts."""
        for rnd in self.rounds:
            task = rnd.tasks.get(worker.worker_id)
            if task is not None and not task.pushed and worker.worker_id not in rnd.received:
                del rnd.tasks[worker.worker_id]
                self.ctx.trainer.sampler.give_back(task.epoch, task.positions)
        worker.tasks.clear()
        if self.rounds:
            await self._maybe_close(self.rounds[0])

    async def _maybe_close(self, current: Round) -> None:
        if current.closing or not set(current.received).issuperset(current.tasks):
            return
        if self.ctx.finished:
            return  # training ended while this round was open: it is abandoned, not applied
        current.closing = True
        done = list(current.received.values())
        samples = sum(t.size for _, t in done)
        if current.total is not None and current.weight_in > 0:
            # Weights sum to 1 over the planned tasks; renormalise over what arrived.
            current.total.div_(current.weight_in)
            await self.ctx.trainer.apply(current.total, samples, buffer_scale=1.0)
        self.round_times.append(time.monotonic() - current.started)
        self.ctx.log.event(
            "round",
            round=current.round_id,
            epoch=current.epoch,
            version=self.ctx.trainer.version,
            round_s=round(self.round_times[-1], 6),
            workers=[
                {"worker": w.name, "batch": t.size, "speed": round(w.speed, 3)} for w, t in done
            ],
        )
        self.rounds.popleft()
        self.ctx.account(done)
        self._plan()
        self._begin_current()

    def summary(self) -> dict[str, object]:
        times = np.array(self.round_times) if self.round_times else np.zeros(1)
        return {
            "rounds": len(self.round_times),
            "round_s_median": float(np.median(times)),
            "round_s_mean": float(times.mean()),
        }
