"""Synchronous rounds: every worker gets a share of a global batch; the round closes when all
shares are in, and their weighted sum is applied as one step.

An epoch's last round holds the ``n mod B`` samples left (its tail); its step is weighted by
its share of a global batch, b / B, on the gradient and on the BatchNorm statistics change,
so a handful of samples never makes a full step (see docs/training-quality.md)."""

from __future__ import annotations

import abc
import collections
import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from common.protocol.messages import PushRequest
from common.training.planner import tail_scale
from pserver.membership import Task, WorkerInfo
from pserver.policies.base import Assignment, Decision, ModePolicy, Update
from pserver.roundtiming import RoundClock, RoundTiming, WorkerTiming

__all__ = ["ROUNDS_AHEAD", "Round", "RoundTiming", "SyncRounds", "WorkerTiming"]

ROUNDS_AHEAD = 2  # the current round and the next (its samples are prefetched meanwhile)


@dataclasses.dataclass
class Round:
    """One synchronous round: its tasks and planned weights, and the pushes accepted so far."""

    round_id: int
    epoch: int
    tasks: dict[int, Task]
    weights: dict[int, float]
    received: dict[int, tuple[WorkerInfo, Task]] = dataclasses.field(default_factory=dict)
    started: float = 0.0
    closing: bool = False
    predicted: dict[int, float] = dataclasses.field(default_factory=dict)
    accepted: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    clips: dict[int, float] = dataclasses.field(default_factory=dict)  # task id -> factor
    scale: float = 1.0

    @property
    def complete(self) -> bool:
        """Every remaining task has been pushed (and at least one was)."""
        return bool(self.received) and set(self.received).issuperset(self.tasks)

    def update(self) -> Update:
        """The round's step: accepted pushes in worker-id order, weights renormalised over them
        (they sum to 1 over the planned tasks; a worker that left takes its weight along),
        then multiplied by the round's ``scale`` (b / B); the weights also weigh the
        statistics changes, so those are scaled alike."""
        weight_in = sum(self.weights[w] for w in self.received)
        entries = [
            (worker, task, self.scale * self.weights[wid] / weight_in)
            for wid, (worker, task) in sorted(self.received.items())
        ]
        steady = frozenset(
            w for w, (worker, _) in self.received.items() if worker.steady_in(self.round_id)
        )
        clock = RoundClock(self.started, dict(self.accepted), dict(self.predicted), steady)
        return Update(
            entries, buffer_scale=1.0, clips=dict(self.clips), round_id=self.round_id, clock=clock
        )


class SyncRounds(ModePolicy):
    """Shared machinery of the synchronous modes; subclasses choose sizes and weights.

    Two rounds are planned ahead, so workers prefetch the next round's data while they compute;
    a round uses the speeds known when it was planned. Rounds left without tasks (every worker
    in them left) are dropped, and planning starts again when workers are ready.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rounds: collections.deque[Round] = collections.deque()
        self.next_round_id = 1
        self.round_times: list[float] = []
        self.last_timing: RoundTiming | None = None
        self.idle_total = 0.0
        self.worker_round_total = 0.0

    @abc.abstractmethod
    def batch_sizes(self, workers: list[WorkerInfo], total: int) -> dict[int, int]:
        """worker id -> local batch, summing to ``total``."""

    @abc.abstractmethod
    def weights(self, sizes: dict[int, int]) -> dict[int, float]:
        """worker id -> weight of its mean gradient; the weights sum to 1."""

    def plan(self, ready: list[WorkerInfo]) -> list[Assignment]:
        made: list[Assignment] = []
        while len(self.rounds) < ROUNDS_AHEAD and ready and not self.sampler.exhausted:
            total = min(self.config.global_batch, self.sampler.remaining_in_epoch())
            sizes = {w: n for w, n in self.batch_sizes(ready, total).items() if n > 0}
            epoch, positions = self.sampler.take(total)
            tasks: dict[int, Task] = {}
            offset = 0
            for worker in ready:
                n = sizes.get(worker.worker_id, 0)
                if n:
                    task = self.tasks.new(epoch, positions[offset : offset + n], self.next_round_id)
                    tasks[worker.worker_id] = task
                    made.append((worker, task))
                    offset += n
            fits = {w.worker_id: w.perf.fit(refit=False) for w in ready}
            predicted = {
                w: fit.predict(n) for w, n in sizes.items() if (fit := fits.get(w)) is not None
            }
            scale = tail_scale(len(positions), self.config.global_batch)
            self.rounds.append(
                Round(
                    self.next_round_id,
                    epoch,
                    tasks,
                    self.weights(sizes),
                    predicted=predicted,
                    scale=scale,
                )
            )
            self.next_round_id += 1
        if self.rounds and not self.rounds[0].started:
            self.rounds[0].started = time.monotonic()
        return made

    def runnable_in(self, worker: WorkerInfo, queue: Sequence[Task]) -> Task | None:
        if not self.rounds or not queue:
            return None
        current = self.rounds[0]
        task = current.tasks.get(worker.worker_id)
        if task is not None and task is queue[0] and worker.worker_id not in current.received:
            return task
        return None

    def decide(
        self, worker: WorkerInfo, task: Task, push: PushRequest, version: int, clip: float
    ) -> Decision:
        return Decision(update=self.accept(worker, task, push, clip))

    def accept(
        self, worker: WorkerInfo, task: Task, push: PushRequest, clip: float = 1.0
    ) -> Update | None:
        """Count ``worker``'s push into the current round; the round's update once complete."""
        current = self.rounds[0]
        current.received[worker.worker_id] = (worker, task)
        current.accepted[worker.worker_id] = (time.monotonic(), push.compute_s)
        if clip != 1.0:
            current.clips[task.task_id] = clip
        return self._close_if_complete()

    def leave(self, worker: WorkerInfo, dropped: list[Task]) -> Update | None:
        gone = {t.task_id for t in dropped}
        for rnd in self.rounds:
            task = rnd.tasks.get(worker.worker_id)
            if task is not None and task.task_id in gone:
                del rnd.tasks[worker.worker_id]
        while self.rounds and not self.rounds[0].tasks:
            self.rounds.popleft()  # nobody is left in it: its samples went back
        self.rounds = collections.deque(r for r in self.rounds if r.tasks)
        if self.rounds and not self.rounds[0].started:
            self.rounds[0].started = time.monotonic()
        return self._close_if_complete()

    def _close_if_complete(self) -> Update | None:
        if not self.rounds:
            return None
        current = self.rounds[0]
        if current.closing or not current.complete:
            return None
        current.closing = True
        return current.update()

    def applied(self, update: Update, timing: RoundTiming | None = None) -> None:
        self._finish(update)
        if timing is None:
            assert update.clock is not None
            timing = update.clock.timing(time.monotonic())
        self.round_times.append(timing.round_s)
        self.last_timing = timing
        self.idle_total += sum(w.idle_s for w in self.last_timing.workers.values())
        self.worker_round_total += len(self.last_timing.workers) * self.last_timing.round_s

    def settle(self, update: Update) -> None:
        """Refit the models of the update's workers: the plan made when their round closed
        used their fits before that round (a refit per plan would delay every reply)."""
        for worker, _, _ in update.entries:
            worker.perf.fit()

    def idle_share(self) -> float | None:
        """Sum of idle time over sum of worker round time, over every applied round."""
        if self.worker_round_total <= 0:
            return None
        return min(self.idle_total / self.worker_round_total, 1.0)

    def refused(self, update: Update) -> None:
        self._finish(update)

    def _finish(self, update: Update) -> Round:
        done = self.rounds.popleft()
        if done.round_id != update.round_id:
            raise RuntimeError(f"round {update.round_id} closed before round {done.round_id}")
        if self.rounds:
            self.rounds[0].started = time.monotonic()
        return done

    def summary(self) -> dict[str, object]:
        times = np.array(self.round_times) if self.round_times else np.zeros(1)
        return {
            "rounds": len(self.round_times),
            "round_s_median": float(np.median(times)),
            "round_s_mean": float(times.mean()),
        }
