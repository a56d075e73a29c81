"""The interface every mode policy implements, and what the server offers it."""

from __future__ import annotations

import abc
from typing import Protocol

import numpy as np
import torch

from common.protocol.messages import PushRequest
from common.training.runlog import RunLog
from pserver.config import ServerConfig
from pserver.membership import Task, WorkerInfo
from pserver.trainer import Trainer


class PolicyContext(Protocol):
    """The server's services to a policy."""

    config: ServerConfig
    trainer: Trainer
    log: RunLog

    @property
    def finished(self) -> bool:
        """Training has ended; no more tasks are planned."""

    def active_workers(self) -> list[WorkerInfo]:
        """Members that are still training, in join order."""

    def new_task(
        self, worker: WorkerInfo, epoch: int, positions: np.ndarray, round_id: int = -1
    ) -> Task:
        """Create a task over ``positions`` and queue it on ``worker``."""

    def release(self) -> None:
        """Answer every waiting worker that now has a task it may run (or must stop)."""

    def account(self, done: list[tuple[WorkerInfo, Task]]) -> None:
        """Book applied tasks: per-worker counters, epoch ledgers, evaluation, stop checks."""


class ModePolicy(abc.ABC):
    """Turns pushes into parameter updates and decides which task each worker runs next."""

    name = ""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    @abc.abstractmethod
    def start(self) -> None:
        """Training begins: plan the first tasks."""

    @abc.abstractmethod
    def runnable(self, worker: WorkerInfo) -> Task | None:
        """The task ``worker`` may run now, if any (it is ``worker.tasks[0]``)."""

    def prefetch_hint(self, worker: WorkerInfo) -> Task | None:
        """The task the worker will most likely run after the current one."""
        return worker.tasks[1] if len(worker.tasks) > 1 else None

    def on_join(self, worker: WorkerInfo) -> None:  # noqa: B027 - optional hook
        """A worker joined after training started."""

    @abc.abstractmethod
    async def on_push(
        self, worker: WorkerInfo, task: Task, push: PushRequest, update: torch.Tensor
    ) -> None:
        """Combine a validated push for ``task`` (``worker.tasks[0]``).

        Raises:
            ProtocolError: the push is rejected (non-finite, too stale); nothing changed.
        """

    @abc.abstractmethod
    async def on_leave(self, worker: WorkerInfo) -> None:
        """``worker`` left; it will push no more."""

    def state(self) -> dict[str, object]:
        """JSON-able counters to keep in a checkpoint."""
        return {}

    def restore(self, state: dict[str, object]) -> None:  # noqa: B027 - optional hook
        """Load what ``state`` returned."""

    def summary(self) -> dict[str, object]:
        """Mode-specific entries for ``summary.json``."""
        return {}
