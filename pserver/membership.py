"""Who takes part in a run: members with their identity proof, liveness deadline, queued tasks
and counters; departed members are folded into per-name counters and forgotten."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from collections.abc import Callable

import numpy as np

from common.errors import ErrorCode, ProtocolError
from common.protocol.tokens import TokenBook
from common.training.perfmodel import PerfModel
from pserver.roundtiming import WorkerTiming

MAX_NAME = 64
MAX_HISTORY = 1024  # departed names remembered; beyond that their counters are pooled
COUNTERS = ("samples", "pushes", "rejected", "non_finite", "refused")
OTHERS = "(others)"


@dataclasses.dataclass
class Task:
    """A slice of one epoch given to one worker.

    Attributes:
        task_id: unique per server run.
        epoch: the epoch the samples belong to.
        positions: positions in the training split (for exactly-once accounting).
        indices: the matching dataset indices (what the worker trains on).
        round_id: the sync round it belongs to (async: -1).
        accepted_at: monotonic time its push was accepted (0: not yet).
    """

    task_id: int
    epoch: int
    positions: np.ndarray
    indices: list[int]
    round_id: int = -1
    accepted_at: float = 0.0

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.indices)


class TaskFactory:
    """Makes tasks with run-unique ids over training-split positions.

    Args:
        train_indices: dataset index of each training-split position.
    """

    def __init__(self, train_indices: np.ndarray) -> None:
        self.train_indices = train_indices
        self._ids = itertools.count(1)

    def new(self, epoch: int, positions: np.ndarray, round_id: int = -1) -> Task:
        """A task over ``positions`` of ``epoch``."""
        indices = self.train_indices[positions].tolist()
        return Task(next(self._ids), epoch, positions, indices, round_id)


def in_round_order(queue: collections.deque[Task] | list[Task], task: Task) -> None:
    """Insert ``task`` into a worker's ``queue`` after its tasks of the same or earlier sync
    rounds (at the end in async mode, where every round is -1)."""
    queue.insert(sum(1 for t in queue if t.round_id <= task.round_id), task)


@dataclasses.dataclass
class Waiter:
    """A request whose reply is deferred until the worker has a task to run; ``with_params``:
    the reply carries the published parameters (the request was a ``gradient_push_request``)."""

    identity: bytes
    request_id: int
    with_params: bool = False


@dataclasses.dataclass
class WorkerInfo:
    """One member of the run; only its ``Roster`` writes it."""

    worker_id: int
    name: str
    device: str
    slowdown: float
    threads: int
    user_id: str = ""
    speed: float = 0.0
    tasks: collections.deque[Task] = dataclasses.field(default_factory=collections.deque)
    waiter: Waiter | None = None
    pushing: int | None = None  # the task whose push is being checked
    samples: int = 0
    pushes: int = 0
    rejected: int = 0
    non_finite: int = 0
    refused: int = 0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    idle_s: float = 0.0  # waiting at sync barriers, summed over rounds
    sent_at: float = 0.0  # monotonic time its last task was sent
    heard_at: float = 0.0  # the loop's time when it was last heard from
    sent_task: int | None = None  # the id of the task it was last sent
    last_round: int = -1  # the last sync round it pushed in
    perf: PerfModel = dataclasses.field(default_factory=PerfModel)
    active: bool = True
    ready: bool = False

    def steady_in(self, round_id: int) -> bool:
        """Whether it pushed in the round before ``round_id``: otherwise (its first round, a
        re-probe) it could not prefetch its data and pulled its parameters, which a steady
        round does not pay, so that round's timing does not describe it."""
        return self.last_round == round_id - 1

    def summary(self) -> dict[str, object]:
        """The per-worker entry of ``summary.json`` and ``pserver status``."""
        fit = self.perf.fit()
        return {
            "name": self.name,
            "device": self.device,
            "slowdown": self.slowdown,
            "cpus": None,  # a launcher that emulates nodes records their budgets and links
            "link": None,
            "speed": round(self.speed, 3),
            **{c: getattr(self, c) for c in COUNTERS},
            "idle_s": round(self.idle_s, 4),
            "model": None if fit is None else fit.as_dict(),
            "active": self.active,
        }


class Roster:
    """The members of a run, with a liveness deadline per worker.

    Every message from a worker pushes its deadline ``dead_after_s`` into the future; a worker
    whose deadline passes is handed to ``on_dead`` (from the event loop, via a timer: no
    polling). Requests prove membership with the token issued at join (and, under CURVE, come
    from the same public key).

    Args:
        dead_after_s: silence after which a worker counts as dead.
        on_dead: called with the worker when its deadline passes.
        tokens: issues and checks worker tokens.
        max_members: how many members may be active at once.
    """

    def __init__(
        self,
        dead_after_s: float,
        on_dead: Callable[[WorkerInfo], None],
        *,
        tokens: TokenBook,
        max_members: int,
    ) -> None:
        self.dead_after_s = dead_after_s
        self.on_dead = on_dead
        self.tokens = tokens
        self.max_members = max_members
        self.workers: dict[int, WorkerInfo] = {}
        self.history: dict[str, dict[str, object]] = {}
        self.emptied = asyncio.Event()  # set whenever the last member is gone
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._next_id = 1

    def add(
        self,
        name: str,
        device: str,
        slowdown: float,
        threads: int,
        user_id: str = "",
    ) -> WorkerInfo:
        """A new member; a name already in use gets the worker id appended (and counts on
        while that is taken too), so every member's name, and each ``/metrics`` series, is
        unique.

        Raises:
            ProtocolError: BUSY when ``max_members`` are active.
        """
        if len(self.workers) >= self.max_members:
            raise ProtocolError(ErrorCode.BUSY, f"the run already has {self.max_members} members")
        name = name[:MAX_NAME]
        names = {w.name for w in self.workers.values()}
        unique, suffix = name, self._next_id
        while unique in names:  # a member may already be called "name-<id>"
            unique, suffix = f"{name}-{suffix}", suffix + 1
        worker = WorkerInfo(self._next_id, unique, device[:MAX_NAME], slowdown, threads, user_id)
        past = self.history.pop(unique, None)
        if past is not None:  # the same worker before it rejoined or the server restarted
            for counter in COUNTERS:
                setattr(worker, counter, int(past.get(counter, 0)))  # type: ignore[call-overload]
            worker.idle_s = float(past.get("idle_s", 0.0))  # type: ignore[arg-type]
        self._next_id += 1
        self.workers[worker.worker_id] = worker
        self.touch(worker)
        return worker

    def member(self, worker_id: int, token: str, user_id: str = "") -> WorkerInfo:
        """The active member behind a request (its liveness deadline restarts).

        Raises:
            ProtocolError: UNKNOWN_WORKER for a wrong token, a departed worker, or (CURVE) a
                request from another key than the one that joined.
        """
        self.tokens.check(worker_id, token)
        worker = self.workers.get(worker_id)
        if worker is None or not worker.active or worker.user_id != user_id:
            raise ProtocolError(
                ErrorCode.UNKNOWN_WORKER, f"worker id {worker_id} is not a member; join first"
            )
        self.touch(worker)
        return worker

    def touch(self, worker: WorkerInfo) -> None:
        """The worker was heard from: restart its liveness deadline."""
        worker.heard_at = asyncio.get_running_loop().time()
        if worker.worker_id not in self._timers:
            self._expire(worker.worker_id)

    def _expire(self, worker_id: int) -> None:
        """Hand the worker to ``on_dead`` once its deadline passed, else wait for the rest."""
        self._timers.pop(worker_id, None)
        worker = self.workers.get(worker_id)
        if worker is None or not worker.active:
            return
        loop = asyncio.get_running_loop()
        left = worker.heard_at + self.dead_after_s - loop.time()
        if left > 0:
            self._timers[worker_id] = loop.call_later(left, self._expire, worker_id)
        else:
            self.on_dead(worker)

    def remove(self, worker: WorkerInfo) -> None:
        """The worker is gone (left, dead or stopped): its counters go to the history."""
        worker.active = False
        worker.waiter = None
        if (timer := self._timers.pop(worker.worker_id, None)) is not None:
            timer.cancel()
        self.workers.pop(worker.worker_id, None)
        self._remember(worker.name, worker.summary())
        if not self.members():
            self.emptied.set()

    # --- what a member does (the only writers of ``WorkerInfo``) ---------------------------

    def calibrated(
        self,
        worker: WorkerInfo,
        speed: float,
        batches: list[int] | None,
        seconds: list[float] | None,
    ) -> bool:
        """A task request reported the worker's speed (and calibration pairs).

        Returns:
            Whether the worker became ready only now.
        """
        worker.speed = speed
        if batches:
            worker.perf.seed(batches, seconds or [])
        first = not worker.ready
        worker.ready = True
        return first

    def wait(self, worker: WorkerInfo, waiter: Waiter) -> None:
        """The worker's request waits for its next task (or its stop)."""
        worker.waiter = waiter

    def take_waiter(self, worker: WorkerInfo) -> Waiter | None:
        """The worker's waiting request, now answered by the caller."""
        waiter, worker.waiter = worker.waiter, None
        return waiter

    def sent(self, worker: WorkerInfo, task: Task) -> Waiter | None:
        """``task`` is sent to the worker now; returns the request that carries it."""
        worker.sent_at = time.monotonic()
        worker.sent_task = task.task_id
        return self.take_waiter(worker)

    def queue(self, worker: WorkerInfo, task: Task) -> None:
        """Queue a planned task for the worker, after its tasks of the same or earlier rounds."""
        in_round_order(worker.tasks, task)

    def requeue(self, worker: WorkerInfo, task: Task) -> None:
        """Put a task back first in the worker's queue (it recomputes the same samples)."""
        worker.tasks.appendleft(task)

    def take_tasks(self, worker: WorkerInfo) -> list[Task]:
        """Empty the worker's queue; returns what it held."""
        dropped = list(worker.tasks)
        worker.tasks.clear()
        return dropped

    def begin_push(self, worker: WorkerInfo, task: Task) -> None:
        """The worker's push of ``task`` is being checked."""
        worker.pushing = task.task_id

    def end_push(self, worker: WorkerInfo) -> None:
        """The worker's push was decided (applied, refused or withdrawn)."""
        worker.pushing = None

    def accepted(
        self,
        worker: WorkerInfo,
        task: Task,
        speed: float,
        compute_s: float,
        transfer_s: float,
        measure_transfer: bool,
    ) -> None:
        """The push of ``task`` (the head of the queue) passed every check: it counts now.

        Args:
            worker: who pushed.
            task: what.
            speed, compute_s, transfer_s: what the push reported.
            measure_transfer: feed the time since the task was sent, less compute, to the
                worker's model (async; sync rounds are timed when they close).
        """
        worker.tasks.popleft()
        task.accepted_at = time.monotonic()
        worker.speed = speed
        worker.compute_s, worker.transfer_s = compute_s, transfer_s
        worker.perf.add_compute(task.size, compute_s)
        if measure_transfer and worker.sent_at:
            worker.perf.add_transfer(time.monotonic() - worker.sent_at - compute_s)

    def count(self, worker: WorkerInfo, counter: str) -> None:
        """One more ``rejected``, ``non_finite`` or ``refused`` push of the worker."""
        if counter not in ("rejected", "non_finite", "refused"):
            raise ValueError(f"not a push counter: {counter}")
        setattr(worker, counter, getattr(worker, counter) + 1)

    def account_round(
        self, worker: WorkerInfo, part: WorkerTiming | None, round_id: int
    ) -> dict[str, object]:
        """Feed a worker's round timing to its model and idle total; its ``round`` event
        fields. Its time outside compute feeds the model only in a steady round
        (``WorkerInfo.steady_in``)."""
        if part is None:
            return {}
        worker.idle_s += part.idle_s
        if worker.steady_in(round_id):
            worker.perf.add_transfer(part.transfer_s)
        worker.last_round = round_id
        fields: dict[str, object] = {
            k: round(getattr(part, k), 6) for k in ("compute_s", "transfer_s", "actual_s", "idle_s")
        }
        if part.predicted_s is not None:
            fields["predicted_s"] = round(part.predicted_s, 6)
        return fields

    def restore_history(self, history: dict[str, dict[str, object]]) -> None:
        """Departed workers' counters from a checkpoint."""
        self.history = {str(k): dict(v) for k, v in history.items()}

    def credit(self, worker: WorkerInfo, samples: int) -> None:
        """Count an applied push of ``worker`` (also after it left: the push still counts)."""
        worker.samples += samples
        worker.pushes += 1
        if not worker.active:
            self._remember(worker.name, worker.summary())

    def _remember(self, name: str, entry: dict[str, object]) -> None:
        if name not in self.history and len(self.history) >= MAX_HISTORY:
            pooled = self.history.setdefault(OTHERS, {"name": OTHERS, "active": False})
            for counter in COUNTERS:
                pooled[counter] = int(pooled.get(counter, 0)) + int(entry.get(counter, 0))  # type: ignore[call-overload]
            return
        self.history[name] = {**entry, "active": False}

    def summaries(self) -> list[dict[str, object]]:
        """Per-worker summaries: departed ones by name, then the members."""
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
