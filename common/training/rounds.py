"""Per-worker compute / transfer / idle time of one sync ``round`` event, for every viewer."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.training.perfmodel import finite

TAIL = 0.02  # the slowest share of rounds whose part of the time is checked
TAIL_LIMIT = 0.2  # above it, a figure rests on a few rounds (a load spike, a stall)
MIN_ROUNDS = 10  # fewer rounds tell nothing about their tail


@dataclasses.dataclass(frozen=True)
class WorkerRound:
    """One worker's part of one round.

    Attributes:
        worker: the worker's name.
        batch: its local batch b_i.
        share: b_i / Σ b_j over the round.
        speed: its measured speed (samples per second of compute), 0 if unknown.
        compute_s: its compute time (forward, backward and emulated slowdown).
        transfer_s: its transfer time, None where the event does not say.
        idle_s: time spent waiting for the others at the barrier.
        predicted_s: the planner's predicted step time, None where the event does not say.
        compute_estimated: compute was estimated as batch / speed (the event has no timing).
        idle_derived: idle was derived as round time minus compute (and transfer).
    """

    worker: str
    batch: int
    share: float
    speed: float
    compute_s: float
    transfer_s: float | None
    idle_s: float
    predicted_s: float | None
    compute_estimated: bool
    idle_derived: bool


def _number(entry: Mapping[str, Any], key: str) -> float | None:
    """``entry[key]`` as a finite float >= 0, or None when absent or not such a number."""
    return finite(entry.get(key), 0.0)


def breakdown(event: Mapping[str, Any]) -> list[WorkerRound]:
    """Split a ``round`` event into each worker's compute, transfer and idle time.

    Uses the best fields present per worker: compute from ``emulated_s`` (compute with the
    emulated slowdown, as DDP records it), else ``compute_s``, else ``actual_s`` (compute
    and transfer, as the server measures it) minus ``transfer_s``, else
    estimated as batch / speed (the whole round when the speed is unknown too); transfer
    from ``transfer_s``; idle from ``idle_s``, else derived as ``round_s`` minus compute and
    transfer (never below 0).

    Args:
        event: a ``round`` record of ``metrics.jsonl`` (``round_s`` and ``workers``).

    Returns:
        One entry per worker with a batch, in the event's order; empty when the event has
        no usable round time or worker list.
    """
    round_s = _number(event, "round_s")
    entries = event.get("workers")
    if round_s is None or not isinstance(entries, list):
        return []
    usable = [
        e
        for e in entries
        if isinstance(e, Mapping)
        and isinstance(e.get("worker"), str)
        and _number(e, "batch") is not None
    ]
    total = sum(int(_number(e, "batch") or 0) for e in usable)
    out = []
    for entry in usable:
        batch = int(_number(entry, "batch") or 0)
        speed = _number(entry, "speed") or 0.0
        transfer = _number(entry, "transfer_s")
        compute = next(
            (v for k in ("emulated_s", "compute_s") if (v := _number(entry, k)) is not None),
            None,
        )
        actual = _number(entry, "actual_s")
        if compute is None and actual is not None:
            compute = max(actual - (transfer or 0.0), 0.0)
        estimated = compute is None
        if compute is None:  # no timing: batch / speed; no speed either: busy all round
            compute = min(batch / speed, round_s) if speed > 0 else (round_s if batch else 0.0)
        idle = _number(entry, "idle_s")
        derived = idle is None
        if idle is None:
            idle = max(round_s - compute - (transfer or 0.0), 0.0)
        out.append(
            WorkerRound(
                worker=entry["worker"],
                batch=batch,
                share=batch / total if total else 0.0,
                speed=speed,
                compute_s=compute,
                transfer_s=transfer,
                idle_s=idle,
                predicted_s=_number(entry, "predicted_s"),
                compute_estimated=estimated,
                idle_derived=derived,
            )
        )
    return out


def idle_share(parts: list[WorkerRound], round_s: float) -> float | None:
    """Share of the workers' round time spent idle: Σ idle_i / (N · round_s); None if empty."""
    if not parts or round_s <= 0:
        return None
    return min(sum(p.idle_s for p in parts) / (len(parts) * round_s), 1.0)


def round_events(run_dir: Path) -> list[dict[str, Any]]:
    """The ``round`` events of a run's ``metrics.jsonl`` (empty when it has none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [e for e in map(json.loads, f) if e.get("event") == "round"]


def round_spread(round_s: Sequence[float]) -> dict[str, float | None]:
    """The median round and the share of all round time that the slowest ``TAIL`` of the
    rounds (at least one) took: above ``TAIL_LIMIT`` an epoch time rests on a few rounds.

    Returns:
        ``{"round_median_s", "round_slowest_s", "tail_share"}`` (None without rounds; the tail
        share None with fewer than ``MIN_ROUNDS``).
    """
    if not round_s:
        return {"round_median_s": None, "round_slowest_s": None, "tail_share": None}
    slowest = sorted(round_s, reverse=True)[: max(1, math.ceil(TAIL * len(round_s)))]
    total = math.fsum(round_s)
    share = math.fsum(slowest) / total if total > 0 and len(round_s) >= MIN_ROUNDS else None
    median = statistics.median(round_s)
    return {"round_median_s": median, "round_slowest_s": slowest[0], "tail_share": share}
