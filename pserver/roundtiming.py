"""How long each worker of a synchronous round computed, transferred and waited."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WorkerTiming:
    """One worker's part of a closed round, as the server measured it.

    Attributes:
        compute_s: compute time the worker reported (emulated slowdown included).
        actual_s: from the round's start to its push being accepted (compute and transfer).
        transfer_s: ``actual_s`` minus compute: parameters and gradient on the wire, data.
        idle_s: from its push being accepted to the round's last push (waiting for others).
        predicted_s: the planner's prediction of ``actual_s``, None without a fitted model.
    """

    compute_s: float
    actual_s: float
    transfer_s: float
    idle_s: float
    predicted_s: float | None


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    """A closed round: ``round_s = actual_s + idle_s + step_s`` for every worker in it."""

    round_s: float
    step_s: float
    workers: dict[int, WorkerTiming]


@dataclasses.dataclass(frozen=True)
class RoundClock:
    """What a round recorded of its pushes, to time it once its step is published.

    Attributes:
        started: monotonic time the round started.
        accepted: worker id -> (monotonic time its push was accepted, its compute seconds).
        predicted: worker id -> the planner's predicted seconds.
        steady: ids of the workers that pushed in the round before (``WorkerInfo.steady_in``).
    """

    started: float
    accepted: dict[int, tuple[float, float]]
    predicted: dict[int, float]
    steady: frozenset[int]

    def timing(self, now: float) -> RoundTiming:
        """The round's timing, its step published at monotonic time ``now``."""
        last = max((t for t, _ in self.accepted.values()), default=now)
        workers = {}
        for wid, (at, compute) in self.accepted.items():
            actual = max(at - self.started, 0.0)
            workers[wid] = WorkerTiming(
                compute_s=compute,
                actual_s=actual,
                transfer_s=max(actual - compute, 0.0),
                idle_s=last - at,
                predicted_s=self.predicted.get(wid),
            )
        return RoundTiming(round_s=now - self.started, step_s=max(now - last, 0.0), workers=workers)
