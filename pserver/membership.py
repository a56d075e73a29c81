"""The server's view of each worker: identity, speed, queued tasks and counters."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable

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
    non_finite: int = 0
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
            "non_finite": self.non_finite,
            "active": self.active,
        }


class Roster:
    """The members of a run, with a liveness deadline per worker.

    Every message from a worker pushes its deadline ``dead_after_s`` into the future; a worker
    whose deadline passes is handed to ``on_dead`` (from the event loop, via a timer: no
    polling).

    Args:
        dead_after_s: silence after which a worker counts as dead.
        on_dead: called with the worker when its deadline passes.
    """

    def __init__(self, dead_after_s: float, on_dead: Callable[[WorkerInfo], None]) -> None:
        self.dead_after_s = dead_after_s
        self.on_dead = on_dead
        self.workers: dict[int, WorkerInfo] = {}
        self.history: dict[str, dict[str, object]] = {}  # counters from before a restart
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._next_id = 1

    def add(self, name: str, device: str, slowdown: float, threads: int, t: float) -> WorkerInfo:
        """A new member; a name already in use gets the worker id appended."""
        names = {w.name for w in self.workers.values()}
        unique = name if name not in names else f"{name}-{self._next_id}"
        worker = WorkerInfo(self._next_id, unique, device, slowdown, threads, 0.0, t)
        past = self.history.pop(unique, None)
        if past is not None:  # the same worker before the server restarted
            for counter in ("samples", "pushes", "rejected", "non_finite"):
                setattr(worker, counter, int(past[counter]))  # type: ignore[call-overload]
        self._next_id += 1
        self.workers[worker.worker_id] = worker
        self.touch(worker)
        return worker

    def touch(self, worker: WorkerInfo) -> None:
        """The worker was heard from: restart its liveness deadline."""
        timer = self._timers.pop(worker.worker_id, None)
        if timer is not None:
            timer.cancel()
        if worker.active:
            loop = asyncio.get_running_loop()
            self._timers[worker.worker_id] = loop.call_later(
                self.dead_after_s, self._expire, worker.worker_id
            )

    def _expire(self, worker_id: int) -> None:
        self._timers.pop(worker_id, None)
        worker = self.workers[worker_id]
        if worker.active:
            self.on_dead(worker)

    def remove(self, worker: WorkerInfo) -> None:
        """Mark the worker gone (left, dead or stopped) and drop its deadline."""
        worker.active = False
        worker.waiter = None
        timer = self._timers.pop(worker.worker_id, None)
        if timer is not None:
            timer.cancel()

    def all_workers(self) -> list[WorkerInfo]:
        """Every worker that joined this server, gone or not."""
        return list(self.workers.values())

    def summaries(self) -> list[dict[str, object]]:
        """Per-worker summaries, including workers known only from before a restart."""
        return [*self.history.values(), *(w.summary() for w in self.workers.values())]

    def members(self) -> list[WorkerInfo]:
        """Workers that joined and are not gone, in join order."""
        return [w for w in self.workers.values() if w.active]

    def ready(self) -> list[WorkerInfo]:
        """Members that have calibrated and take tasks, in join order."""
        return [w for w in self.workers.values() if w.active and w.ready]

    def close(self) -> None:
        """Cancel every deadline."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
