"""The server's view of each worker: identity, speed, queued tasks and counters."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class Task:
    """A slice of one epoch given to one worker.

    Attributes:
        task_id: unique per server run.
        epoch: the epoch the samples belong to.
        positions: positions in the training split (for exactly-once accounting).
        indices: the matching dataset indices (what the worker trains on).
        round_id: the sync round it belongs to (async: -1).
        pushed: its push is being applied, so it must not be handed out again.
    """

    task_id: int
    epoch: int
    positions: np.ndarray
    indices: list[int]
    round_id: int = -1
    pushed: bool = False

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.indices)


@dataclasses.dataclass
class Waiter:
    """A request whose reply is deferred until the worker has a task to run."""

    identity: bytes
    request_id: int


@dataclasses.dataclass
class WorkerInfo:
    """One member of the run."""

    worker_id: int
    name: str
    device: str
    slowdown: float
    threads: int
    speed: float
    joined_t: float
    tasks: collections.deque[Task] = dataclasses.field(default_factory=collections.deque)
    waiter: Waiter | None = None
    samples: int = 0
    pushes: int = 0
    rejected: int = 0
    active: bool = True
    ready: bool = False

    def summary(self) -> dict[str, object]:
        """The per-worker entry of ``summary.json`` and ``pserver status``."""
        return {
            "name": self.name,
            "device": self.device,
            "slowdown": self.slowdown,
            "speed": round(self.speed, 3),
            "samples": self.samples,
            "pushes": self.pushes,
            "rejected": self.rejected,
            "active": self.active,
        }
