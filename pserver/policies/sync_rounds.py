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

import numpy as np

from common.protocol.messages import PushRequest
from common.training.planner import plan_by_speed, tail_scale
from pserver.membership import Task, TaskFactory, WorkerInfo
from pserver.policies.base import Assignment, Decision, ModePolicy, Update
from pserver.roundtiming import RoundClock, RoundTiming, WorkerTiming
from pserver.store.slices import MAX_STAGED_PER_WORKER

__all__ = ["ROUNDS_AHEAD", "Round", "RoundTiming", "SyncRounds", "WorkerTiming"]

ROUNDS_AHEAD = 2  # the current round and the next (its samples are prefetched meanwhile)


@dataclasses.dataclass
class Round:
    """One synchronous round: its tasks and planned weights, and the pushes accepted so far.

    Tasks, weights, pushes and clips are keyed by task id; a worker may hold several tasks
    of a round (it took over the samples of one that left). ``orphans`` are tasks whose
    worker left before pushing: the round waits until they are planned again among the ready
    workers, so its update covers the samples it was planned with."""

    round_id: int
    epoch: int
    tasks: dict[int, tuple[WorkerInfo, Task]]
    weights: dict[int, float]
    received: dict[int, tuple[WorkerInfo, Task]] = dataclasses.field(default_factory=dict)
    orphans: list[Task] = dataclasses.field(default_factory=list)
    started: float = 0.0
    closing: bool = False
    predicted: dict[int, float] = dataclasses.field(default_factory=dict)  # worker id ->
    accepted: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)  # idem
    clips: dict[int, float] = dataclasses.field(default_factory=dict)
    scale: float = 1.0

    @property
    def complete(self) -> bool:
        """Every task has been pushed (and at least one was)."""
        return (
            bool(self.received) and not self.orphans and self.received.keys() >= self.tasks.keys()
        )

    def update(self) -> Update:
        """The round's step: the pushes in worker-id order, each weighted by its planned
        weight times the round's ``scale`` (b / B); the weights also weigh the statistics
        changes, so those are scaled alike."""
        entries = [
            (worker, task, self.scale * self.weights[tid])
            for tid, (worker, task) in sorted(
                self.received.items(), key=lambda item: (item[1][0].worker_id, item[0])
            )
        ]
        steady = frozenset(
            w.worker_id for w, _ in self.received.values() if w.steady_in(self.round_id)
        )
        clock = RoundClock(self.started, dict(self.accepted), dict(self.predicted), steady)
        return Update(
            entries, buffer_scale=1.0, clips=dict(self.clips), round_id=self.round_id, clock=clock
        )

    def adopt(self, ready: list[WorkerInfo], minimum: int, tasks: TaskFactory) -> list[Assignment]:
        """Plan the orphans again among ``ready`` (the round's own workers first), sized by
        speed; each new task takes its share of the orphan's weight. A worker holds at most
        ``MAX_STAGED_PER_WORKER`` tasks of a round (the gradients a store keeps staged for
        it): when every ready worker does, the orphans wait for a worker to join."""
        if not self.orphans:
            return []
        held = collections.Counter(w.worker_id for w, _ in self.tasks.values())
        free = [w for w in ready if held[w.worker_id] < MAX_STAGED_PER_WORKER]
        members = [w for w in free if held[w.worker_id]] or free
        made: list[Assignment] = []
        while self.orphans and members:
            orphan = self.orphans.pop()
            weight = self.weights.pop(orphan.task_id)
            speeds = {w.worker_id: w.speed for w in members}
            sizes, offset = plan_by_speed(speeds, orphan.size, (), minimum), 0
            for worker in members:
                n = sizes.get(worker.worker_id, 0)
                if n:
                    task = tasks.new(
                        self.epoch, orphan.positions[offset : offset + n], self.round_id
                    )
                    self.tasks[task.task_id] = (worker, task)
                    self.weights[task.task_id] = weight * n / orphan.size
                    made.append((worker, task))
                    offset += n
        return made


class SyncRounds(ModePolicy):
    """Shared machinery of the synchronous modes; subclasses choose sizes and weights.

    Two rounds are planned ahead, so workers prefetch the next round's data while they compute;
    a round uses the speeds known when it was planned. The tasks of a worker that leaves
    before pushing are planned again in the same round (``Round.adopt``), so every update
    covers the samples its round was planned with, whoever leaves; with nobody ready, the
    round waits for a worker to join.
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
        minimum = self.config.min_local_batch or 1
        made = [a for rnd in self.rounds for a in rnd.adopt(ready, minimum, self.tasks)]
        while len(self.rounds) < ROUNDS_AHEAD and ready and not self.sampler.exhausted:
            total = min(self.config.global_batch, self.sampler.remaining_in_epoch())
            sizes = {w: n for w, n in self.batch_sizes(ready, total).items() if n > 0}
            epoch, positions = self.sampler.take(total)
            tasks: dict[int, tuple[WorkerInfo, Task]] = {}
            weights: dict[int, float] = {}
            planned = self.weights(sizes)
            offset = 0
            for worker in ready:
                n = sizes.get(worker.worker_id, 0)
                if n:
                    task = self.tasks.new(epoch, positions[offset : offset + n], self.next_round_id)
                    tasks[task.task_id] = (worker, task)
                    weights[task.task_id] = planned[worker.worker_id]
                    made.append((worker, task))
                    offset += n
            fits = {w.worker_id: w.perf.fit(refit=False) for w in ready}
            predicted = {
                w: fit.predict(n) for w, n in sizes.items() if (fit := fits.get(w)) is not None
            }
            scale = tail_scale(len(positions), self.config.global_batch)
            rnd = Round(self.next_round_id, epoch, tasks, weights, predicted=predicted, scale=scale)
            self.rounds.append(rnd)
            self.next_round_id += 1
        if self.rounds and not self.rounds[0].started:
            self.rounds[0].started = time.monotonic()
        return made

    def runnable(self, worker: WorkerInfo) -> Task | None:
        queue = worker.tasks
        if not self.rounds or not queue:
            return None
        return queue[0] if queue[0].task_id in self.rounds[0].tasks else None

    def decide(
        self, worker: WorkerInfo, task: Task, push: PushRequest, version: int, clip: float
    ) -> Decision:
        return Decision(update=self.accept(worker, task, push, clip))

    def accept(
        self, worker: WorkerInfo, task: Task, push: PushRequest, clip: float = 1.0
    ) -> Update | None:
        """Count ``worker``'s push into the current round; the round's update once complete."""
        current = self.rounds[0]
        current.received[task.task_id] = (worker, task)
        _, before = current.accepted.get(worker.worker_id, (0.0, 0.0))  # an earlier task of it
        current.accepted[worker.worker_id] = (time.monotonic(), before + push.compute_s)
        if clip != 1.0:
            current.clips[task.task_id] = clip
        return self._close_if_complete()

    def leave(self, worker: WorkerInfo, dropped: list[Task]) -> list[Task]:
        """The worker's unpushed tasks become orphans of their rounds, planned again among
        the ready workers by the next ``plan``: no sample goes back, no update changes."""
        gone = {t.task_id for t in dropped}
        kept = set()
        for rnd in self.rounds:
            for task_id in gone & rnd.tasks.keys():
                rnd.orphans.append(rnd.tasks.pop(task_id)[1])
                kept.add(task_id)
        return [t for t in dropped if t.task_id not in kept]

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
        """Refit the models of the update's workers that took in ``REFIT_EVERY`` pushes since
        their last fit: the plan made when their round closed used their fits before that round
        (a refit per plan would delay every reply); a change point is refitted by the plan
        itself."""
        for worker, _, _ in update.entries:
            worker.perf.refresh()

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
