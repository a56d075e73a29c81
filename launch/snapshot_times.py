"""Time to target from snapshots, for ``pslaunch compare --snapshot-every N``.

Every run saves a snapshot every N updates (async: every N x workers pushes, since one push
applies about B / workers samples, so snapshots are about equally many samples apart in every
mode). After the run, ``pserver evaluate-snapshots`` scores them on the whole test split and
the time to target becomes the training time at which the first version reaching the target
was produced, instead of the time of the first per-epoch evaluation above it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from common.errors import PSError
from pserver.snapshots.snapshot_eval import SnapshotEvalConfig, evaluate_snapshots

log = logging.getLogger(__name__)

SOURCE_SNAPSHOTS = "snapshots"
SOURCE_EVALUATIONS = "evaluations"


def interval(mode: str, every: int, workers: int) -> int:
    """Updates between snapshots for ``mode`` (async pushes are ~1/workers of a batch)."""
    return every * workers if mode == "async" else every


def server_options(mode: str, every: int | None, workers: int) -> list[str]:
    """``pserver start`` options that save the snapshots (none when ``every`` is None).

    With snapshots the server evaluates only at the end: the curve comes from the snapshots,
    and in-run evaluations would only take cores from the workers of the same machine.
    """
    if every is None:
        return []
    return ["--snapshot-every-updates", str(interval(mode, every, workers)), "--eval-every", "0"]


def score_run(
    run_dir: Path,
    target: float | None,
    every: int | None,
    threads: int = 1,
    allow_model: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Score a finished run's snapshots; the fields they add to its compare.json entry.

    Args:
        run_dir: the run directory (with ``snapshots/``).
        target: the target OA (None: no time to target).
        every: the compare's ``--snapshot-every`` (None: snapshots are off; nothing is done).
        threads: torch threads for the evaluation.
        allow_model: the user model the runs were given (``package.module:factory``), if any.

    Returns:
        ``{"time_to_target_source": "evaluations"}`` when snapshots are off or could not be
        scored (then also ``"snapshot_error"``); else ``"snapshots"`` with ``"time_to_target_s"``
        (training time of the first snapshot reaching the target, or None), ``"snapshot_every"``
        (updates) and ``"snapshot_curve"`` (one point per snapshot, in the curve format).
    """
    if every is None:
        return {"time_to_target_source": SOURCE_EVALUATIONS}
    config = SnapshotEvalConfig(
        run_dir, target_oa=target, threads=threads, progress=False, allow_model=allow_model
    )
    try:
        result = evaluate_snapshots(config)
    except PSError as exc:
        log.error("compare: snapshots of %s not scored: %s", run_dir.name, exc)
        return {"time_to_target_source": SOURCE_EVALUATIONS, "snapshot_error": str(exc)}
    first = result["first"]
    curve = [
        {
            "time_s": row["train_time_s"],
            "samples": row["samples"],
            "version": row["version"],
            **{k: row[k] for k in ("oa", "aa", "kappa")},
        }
        for row in result["rows"]
    ]
    return {
        "time_to_target_source": SOURCE_SNAPSHOTS,
        "time_to_target_s": None if first is None else first["train_time_s"],
        "time_to_target_version": None if first is None else first["version"],
        "snapshot_every": result["every"],
        "snapshot_curve": curve,
    }
