"""async: each push is applied at once, its learning rate scaled by batch share and staleness."""

from __future__ import annotations

from common.errors import ErrorCode, ProtocolError
from common.protocol.messages import PushRequest
from common.training.planner import async_batches
from pserver.membership import Task, WorkerInfo
from pserver.policies.base import Assignment, Decision, ModePolicy, Update
from pserver.policies.staleness import lr_scale, staleness_function, too_stale
from pserver.roundtiming import RoundTiming

QUEUE_DEPTH = 2  # the task being computed and the one being prefetched
COUNTERS = {"applied": "applied_count"}  # checkpoint key -> counter
COUNTERS |= {name: name for name in ("rejected", "staleness_sum", "staleness_max")}


class AsyncPolicy(ModePolicy):
    """lr_eff = lr * (b_i / B) * f(tau); pushes older than ``--max-staleness`` are refused.

    A worker runs its next task only once its previous push has been applied (or refused), so
    it always computes on parameters that include its own last step.
    """

    name = "async"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        cfg = self.config
        self.f = staleness_function(cfg.staleness, cfg.staleness_a, cfg.staleness_b)
        self.staleness_sum = 0
        self.staleness_max = 0
        self.applied_count = 0
        self.rejected = 0

    def plan(self, ready: list[WorkerInfo]) -> list[Assignment]:
        made: list[Assignment] = []
        sizes = async_batches({w.worker_id: w.speed for w in ready}, self.config.global_batch)
        for worker in ready:
            while len(worker.tasks) + _count(made, worker) < QUEUE_DEPTH:
                if self.sampler.exhausted:
                    return made
                epoch, positions = self.sampler.take(sizes[worker.worker_id])
                if len(positions) == 0:
                    return made
                made.append((worker, self.tasks.new(epoch, positions)))
        return made

    def runnable(self, worker: WorkerInfo) -> Task | None:
        if worker.pushing is not None or not worker.tasks:
            return None
        return worker.tasks[0]

    def decide(
        self, worker: WorkerInfo, task: Task, push: PushRequest, version: int, clip: float
    ) -> Decision:
        """Apply the push now unless it is older than ``--max-staleness`` versions."""
        tau = version - push.version
        limit = self.config.max_staleness
        if too_stale(tau, limit):
            self.rejected += 1
            refusal = ProtocolError(
                ErrorCode.STALE,
                f"push is {tau} versions old, more than --max-staleness "
                f"{limit}; pull the current parameters and recompute",
            )
            return Decision(refusal=refusal)
        share = task.size / self.config.global_batch
        clips = {task.task_id: clip} if clip != 1.0 else {}
        update = Update(
            [(worker, task, 1.0)],
            buffer_scale=share,
            lr_scale=lr_scale(self.f, tau, task.size, self.config.global_batch),
            staleness=tau,
            clips=clips,
        )
        return Decision(update=update)

    def leave(self, worker: WorkerInfo, dropped: list[Task]) -> list[Task]:
        return dropped

    def applied(self, update: Update, timing: RoundTiming | None = None) -> None:
        self.applied_count += 1
        self.staleness_sum += update.staleness
        self.staleness_max = max(self.staleness_max, update.staleness)

    def staleness(self) -> dict[str, float] | None:
        """Mean and max staleness of applied pushes."""
        if not self.applied_count:
            return {"mean": 0.0, "max": 0}
        return {"mean": self.staleness_sum / self.applied_count, "max": self.staleness_max}

    def state(self) -> dict[str, object]:
        return {key: getattr(self, name) for key, name in COUNTERS.items()}

    def restore(self, state: dict[str, object]) -> None:
        for key, name in COUNTERS.items():
            setattr(self, name, int(state[key]))  # type: ignore[call-overload]

    def summary(self) -> dict[str, object]:
        return {"rejected_stale": self.rejected}


def _count(made: list[Assignment], worker: WorkerInfo) -> int:
    return sum(1 for w, _ in made if w is worker)
