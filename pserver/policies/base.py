"""The interface every mode policy implements. Policies decide; the server acts.

A policy plans tasks (returning them; the server queues them), says which task a worker may
run, and turns accepted pushes into ``Update``s. It never sends, applies or books anything:
the server does, once per message.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

from common.protocol.messages import PushRequest
from pserver.config import ServerConfig
from pserver.membership import Task, TaskFactory, WorkerInfo
from pserver.sampler import EpochSampler

Assignment = tuple[WorkerInfo, Task]


def _no_scaling(tau: int) -> float:
    return 1.0


@dataclasses.dataclass
class Update:
    """One optimizer step a policy asks for.

    Attributes:
        entries: the pushes it combines, in summation order (worker id), with their weights.
        buffer_scale: factor on the summed buffer changes.
        based_on: async: the version the gradient was computed on (None: the current one).
        lr_scale: factor on the scheduled learning rate for staleness tau; may raise
            ``ProtocolError(STALE)`` to refuse the update.
        round_id: the sync round it closes (async: -1).
    """

    entries: list[tuple[WorkerInfo, Task, float]]
    buffer_scale: float
    based_on: int | None = None
    lr_scale: Callable[[int], float] = _no_scaling
    round_id: int = -1

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
        """Their weights, in summation order."""
        return [weight for _, _, weight in self.entries]


class ModePolicy(abc.ABC):
    """Turns pushes into updates and decides which task each worker runs next.

    Args:
        config: the server configuration.
        sampler: the epoch sampler (the policy takes positions from it when planning).
        tasks: makes tasks.
    """

    name = ""

    def __init__(self, config: ServerConfig, sampler: EpochSampler, tasks: TaskFactory) -> None:
        self.config, self.sampler, self.tasks = config, sampler, tasks

    @abc.abstractmethod
    def plan(self, ready: list[WorkerInfo]) -> list[Assignment]:
        """New tasks for the ready workers (called whenever work may be planned)."""

    @abc.abstractmethod
    def runnable(self, worker: WorkerInfo) -> Task | None:
        """The task ``worker`` may run now, if any (it is ``worker.tasks[0]``)."""

    def prefetch_hint(self, worker: WorkerInfo) -> Task | None:
        """The task the worker will most likely run after the current one."""
        return worker.tasks[1] if len(worker.tasks) > 1 else None

    @abc.abstractmethod
    def accept(self, worker: WorkerInfo, task: Task, push: PushRequest) -> Update | None:
        """A push for ``task`` arrived complete and passed every check; it now counts.

        Returns:
            The update that is now due, if any.
        """

    @abc.abstractmethod
    def leave(self, worker: WorkerInfo, dropped: list[Task]) -> Update | None:
        """``worker`` is gone; ``dropped`` are its tasks that will never be pushed (the server
        gives their samples back). Returns an update that is now due, if any."""

    def applied(self, update: Update, tau: int) -> None:  # noqa: B027 - optional hook
        """``update`` was applied with staleness ``tau``."""

    def refused(self, update: Update) -> None:  # noqa: B027 - optional hook
        """``update`` was not applied (stale or invalid); the server handles its tasks."""

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
