"""A bounded live history of a run (evaluations, rounds, pushes) fed by its run-log events."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from common.training.rounds import breakdown, idle_share

MAX_EVALS = 1000
MAX_ROUNDS = 60
MAX_PUSHES = 300
MAX_WORKERS = 1024
EVAL_KEYS = (
    "t",
    "version",
    "epoch",
    "samples",
    "oa",
    "aa",
    "kappa",
    "loss",
    "test_samples",
    "subset",
)


def _clean(value: Any) -> Any:
    """A JSON-safe scalar: NaN and infinities become None (strict JSON for the browser)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _flat(record: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {k: _clean(record.get(k)) for k in keys}


@dataclasses.dataclass(slots=True)
class WorkerTotals:
    """What the events say about one worker, summed over the whole run."""

    batch_share: float | None = None
    compute_s: float = 0.0
    idle_s: float = 0.0
    round_s: float = 0.0
    idle_derived: bool = False
    pushes: int = 0
    samples: int = 0
    staleness_last: int | None = None
    staleness_max: int | None = None
    staleness_sum: int = 0

    def to_json(self) -> dict[str, Any]:
        """The totals as JSON-ready data (idle share over this worker's rounds)."""
        return {
            "batch_share": self.batch_share,
            "compute_s": round(self.compute_s, 4),
            "idle_s": round(self.idle_s, 4),
            "idle_share": round(self.idle_s / self.round_s, 4) if self.round_s > 0 else None,
            "idle_derived": self.idle_derived,
            "staleness_last": self.staleness_last,
            "staleness_mean": round(self.staleness_sum / self.pushes, 3) if self.pushes else None,
            "staleness_max": self.staleness_max,
        }


class LiveView:
    """Keeps what the status page draws, in bounded memory, from the run's events.

    Call it with each event (a ``RunLog`` sink): it is cheap and never blocks. Evaluations
    are kept up to ``MAX_EVALS`` (then every other one is dropped, so the curve keeps its
    whole time span), the newest ``MAX_ROUNDS`` rounds and ``MAX_PUSHES`` pushes, and
    per-worker totals over the whole run.

    Args:
        events: events recorded before the view was attached (replayed in order).
    """

    def __init__(self, events: Iterable[Mapping[str, Any]] = ()) -> None:
        self.start: dict[str, Any] = {}
        self.train_start: float | None = None
        self.evals: list[dict[str, Any]] = []
        self.rounds: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_ROUNDS)
        self.pushes: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_PUSHES)
        self.workers: dict[str, WorkerTotals] = {}
        self.rounds_seen = 0
        self.pushes_seen = 0
        self.last_t = 0.0
        self._evals_json: str | None = None  # encoded once per new evaluation
        for event in events:
            self(event)

    def __call__(self, record: Mapping[str, Any]) -> None:
        """Take one event into the view."""
        kind = record.get("event")
        t = _clean(record.get("t"))
        if isinstance(t, int | float):
            self.last_t = float(t)
        if kind == "start":
            self.start = {
                k: _clean(v) for k, v in record.items() if isinstance(v, str | int | float)
            }
        elif kind == "train_start" and self.train_start is None:
            self.train_start = self.last_t
        elif kind == "eval":
            self._eval(record)
        elif kind == "round":
            self._round(record)
        elif kind == "push":
            self._push(record)

    def _worker(self, name: str) -> WorkerTotals:
        totals = self.workers.get(name)
        if totals is None:
            if len(self.workers) >= MAX_WORKERS:
                self.workers.pop(next(iter(self.workers)))  # the longest-known one
            totals = self.workers[name] = WorkerTotals()
        return totals

    def _eval(self, record: Mapping[str, Any]) -> None:
        self._evals_json = None
        self.evals.append(_flat(record, EVAL_KEYS))
        if len(self.evals) > MAX_EVALS:
            last = self.evals[-1]
            self.evals = [*self.evals[:-1:2], last]

    def _round(self, record: Mapping[str, Any]) -> None:
        parts = breakdown(record)
        if not parts:
            return  # no usable round time or workers
        round_s = float(record["round_s"])
        self.rounds_seen += 1
        self.rounds.append(
            {
                **_flat(record, ("t", "round", "version")),
                "round_s": round_s,
                "idle_share": idle_share(parts, round_s),
                "workers": [
                    {
                        "worker": p.worker,
                        "batch": p.batch,
                        "share": round(p.share, 4),
                        "compute_s": round(p.compute_s, 6),
                        "transfer_s": p.transfer_s,
                        "idle_s": round(p.idle_s, 6),
                        "compute_estimated": p.compute_estimated,
                        "idle_derived": p.idle_derived,
                    }
                    for p in parts
                ],
            }
        )
        planned = {part.worker for part in parts}
        for name, totals in self.workers.items():
            if name not in planned and totals.round_s > 0:
                totals.batch_share = 0.0  # in earlier rounds, planned at 0 in this one (or gone)
        for part in parts:
            totals = self._worker(part.worker)
            totals.batch_share = round(part.share, 4)
            totals.compute_s += part.compute_s
            totals.idle_s += part.idle_s
            totals.round_s += round_s
            totals.idle_derived = totals.idle_derived or part.idle_derived
            totals.samples += part.batch

    def _push(self, record: Mapping[str, Any]) -> None:
        name = str(record.get("worker", "?"))
        batch = record.get("batch")
        batch = batch if isinstance(batch, int) and batch > 0 else 0
        staleness = record.get("staleness")
        self.pushes_seen += 1
        self.pushes.append(
            {
                **_flat(record, ("t", "version")),
                "worker": name,
                "batch": batch,
                "staleness": staleness if isinstance(staleness, int) else None,
            }
        )
        totals = self._worker(name)
        totals.samples += batch
        if isinstance(staleness, int):
            totals.pushes += 1
            totals.staleness_last = staleness
            totals.staleness_sum += staleness
            totals.staleness_max = max(totals.staleness_max or 0, staleness)
        everyone = sum(w.samples for w in self.workers.values())
        if everyone:
            for other in self.workers.values():
                other.batch_share = round(other.samples / everyone, 4)

    def to_json(self, now: float) -> str:
        """``snapshot()`` plus ``"now"`` as strict JSON, the evaluations encoded only once.

        Args:
            now: seconds since the run started.

        Returns:
            The JSON text answered on ``/history.json``.
        """
        if self._evals_json is None:
            self._evals_json = json.dumps(self.evals)
        rest = self.snapshot(with_evals=False)
        rest["now"] = round(_clean(float(now)) or 0.0, 4)
        return '{"evals": ' + self._evals_json + ", " + json.dumps(rest, allow_nan=False)[1:]

    def snapshot(self, with_evals: bool = True) -> dict[str, Any]:
        """Everything the page draws besides the status map, JSON-ready.

        Returns:
            ``{"start", "train_start", "t", "evals", "rounds", "pushes", "workers",
            "rounds_seen", "pushes_seen"}``.
        """
        snap = {
            "start": self.start,
            "train_start": self.train_start,
            "t": self.last_t,
            "rounds": list(self.rounds),
            "pushes": list(self.pushes),
            "workers": {name: w.to_json() for name, w in self.workers.items()},
            "rounds_seen": self.rounds_seen,
            "pushes_seen": self.pushes_seen,
        }
        if with_evals:
            snap["evals"] = list(self.evals)
        return snap
