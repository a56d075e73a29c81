"""The interface every mode policy implements. Policies decide; the server acts.

A policy plans tasks (returning them; the server queues them), says which task a worker may
run, and answers each accepted push once with a ``Decision``: the update now due (if any), or
the push refused. After the server applied an update it asks once more, for the tasks that
follow. It never sends, applies or books anything: the server does.
"""

from __future__ import annotations

import abc
import dataclasses

from common.errors import ProtocolError
from common.protocol.messages import PushRequest
from pserver.config import ServerConfig
from pserver.membership import Task, TaskFactory, WorkerInfo
from pserver.roundtiming import RoundClock, RoundTiming
from pserver.sampler import EpochSampler

Assignment = tuple[WorkerInfo, Task]


@dataclasses.dataclass
class Update:
    """One optimizer step a policy asks for.

    Attributes:
        entries: the pushes it combines, in summation order (worker id), with their weights.
        buffer_scale: factor on the summed buffer changes.
        lr_scale: factor on the scheduled learning rate (async: batch share and staleness).
        staleness: versions published since its gradient's version (async; 0 in sync modes).
        clips: task id -> clipping factor on its weight (``--max-grad-norm``; absent: 1).
        round_id: the sync round it closes (async: -1).
        clock: the sync round's push times, to time it once it is published (async: None).
    """

    entries: list[tuple[WorkerInfo, Task, float]]
    buffer_scale: float
    lr_scale: float = 1.0
    staleness: int = 0
    clips: dict[int, float] = dataclasses.field(default_factory=dict)
    round_id: int = -1
    clock: RoundClock | None = None

    @property
    def samples(self) -> int:
        """Training samples the update covers."""
        return sum(task.size for _, task, _ in self.entries)

    @property
    def task_ids(self) -> list[int]:
        """The combined tasks, in summation order."""
        return [task.task_id for _, task, _ in self.entries]

    @property
    def weights(self) -> list[float]:
        """Their planned weights, in summation order."""
        return [weight for _, _, weight in self.entries]

    @property
    def clipped_weights(self) -> list[float]:
        """The weights the stores sum the gradients with: planned weight times clip factor."""
        return [w * self.clips.get(task.task_id, 1.0) for _, task, w in self.entries]


@dataclasses.dataclass
class Decision:
    """A policy's one answer to an accepted push.

    Attributes:
        update: the step now due (it includes this push), or None: the push waits for its
            round to close.
        refusal: the push is refused (too stale) and nothing is applied; its task goes back
            to the worker, which recomputes it on fresh parameters, and its request is
            answered with this error.

    The pushes an update answers get their replies once it is published (``after_update``).
    """

    update: Update | None = None
    refusal: ProtocolError | None = None


class ModePolicy(abc.ABC):
    """Turns pushes into updates and decides which task each worker runs next.

    Args:
        config: the server configuration.
        sampler: the epoch sampler (the policy takes positions from it when planning).
        tasks: makes tasks.
    """

    name = ""

    def __init__(self, config: ServerConfig, sampler: EpochSampler, *, tasks: TaskFactory) -> None:
        self.config, self.sampler, self.tasks = config, sampler, tasks

    @abc.abstractmethod
    def plan(self, ready: list[WorkerInfo]) -> list[Assignment]:
        """New tasks for the ready workers (called whenever work may be planned)."""

    @abc.abstractmethod
    def runnable(self, worker: WorkerInfo) -> Task | None:
        """The task ``worker`` may run now, if any (it is ``worker.tasks[0]``)."""

    @abc.abstractmethod
    def decide(
        self, worker: WorkerInfo, task: Task, push: PushRequest, version: int, clip: float
    ) -> Decision:
        """A push for ``task`` arrived complete and passed every check: what becomes of it.

        Args:
            worker: who pushed (``task`` is no longer in its queue).
            task: the task pushed.
            push: the request.
            version: the published version (the caller holds the updater's lock, so it is
                the version the update will be applied to).
            clip: the factor on its gradient (``--max-grad-norm``; 1: not clipped).
        """

    def after_update(
        self,
        update: Update,
        timing: RoundTiming | None,
        ready: list[WorkerInfo],
    ) -> list[Assignment]:
        """``update`` was published: count it and plan what comes next (the server queues
        the tasks, then answers the waiting workers that may run now).

        Args:
            update: the published update.
            timing: its round's timing (sync modes).
            ready: the workers to plan for (none once training ended).
        """
        self.applied(update, timing)
        return self.plan(ready)

    @abc.abstractmethod
    def leave(self, worker: WorkerInfo, dropped: list[Task]) -> list[Task]:
        """``worker`` is gone; ``dropped`` are its tasks that will never be pushed. Returns
        those whose samples go back to the sampler (the policy plans the others again)."""

    def applied(self, update: Update, timing: RoundTiming | None) -> None:  # noqa: B027
        """``update`` was published (an optional hook of ``after_update``)."""

    def settle(self, update: Update) -> None:  # noqa: B027 - optional hook
        """Work ``update``'s workers need not wait for, done once they have their next
        tasks."""

    def refused(self, update: Update) -> None:  # noqa: B027 - optional hook
        """``update`` was not applied (invalid, or training ended); the server handles its
        tasks."""

    def state(self) -> dict[str, object]:
        """JSON-able counters to keep in a checkpoint."""
        return {}

    def restore(self, state: dict[str, object]) -> None:  # noqa: B027 - optional hook
        """Load what ``state`` returned."""

    def idle_share(self) -> float | None:
        """Share of worker round time spent waiting at the barrier (None in async mode)."""
        return None

    def staleness(self) -> dict[str, float] | None:
        """Mean and max staleness of applied pushes (None in sync modes)."""
        return None

    def summary(self) -> dict[str, object]:
        """Mode-specific entries for ``summary.json``."""
        return {}
