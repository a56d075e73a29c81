"""The one schema of ``summary.json`` (docs/run-files.md), for the server and the DDP baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SCORE_KEYS = ("oa", "aa", "kappa", "loss")
# The keys every ``summary.json`` starts with, in this order (docs/run-files.md); launchers
# may add keys after them (e.g. the emulated cluster's description).
SUMMARY_KEYS = (
    "mode",
    "model",
    "dataset",
    "wall_time_s",
    "train_time_s",
    "steps",
    "epochs",
    "samples_seen",
    "final",
    "best_oa",
    "target_oa",
    "time_to_target_s",
    "workers",
    "staleness",
    "idle_share",
    "per_class",
    "finish_reason",
    "global_batch",
    "details",
)


def final_eval(evals: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The final evaluation: the highest version, and of that version the one marked ``final``
    (on the whole test split) over an in-run one on a subset."""
    if not evals:
        return None
    return max(evals, key=lambda r: (r["version"], bool(r.get("final"))))


def per_class_of(evals: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any] | None:
    """The ``per_class`` map of the final evaluation (the highest version).

    Args:
        evals: every ``eval`` record.
        names: the dataset's class names.

    Returns:
        ``{"names", "accuracy", "support", "confusion"}``, or None without an evaluation
        that carries per-class results.
    """
    final = final_eval(evals)
    if final is None or "accuracy" not in final:
        return None
    return {
        "names": list(names),
        "accuracy": final["accuracy"],
        "support": final["support"],
        "confusion": final["confusion"],
    }


def run_summary(
    *,
    mode: str,
    model: str,
    dataset: str,
    wall_time_s: float,
    train_time_s: float,
    steps: int,
    epochs: int,
    samples_seen: int,
    evals: Sequence[dict[str, Any]],
    target_oa: float | None,
    time_to_target_s: float | None,
    workers: list[dict[str, Any]],
    staleness: dict[str, float] | None,
    finish_reason: str,
    global_batch: int,
    idle_share: float | None = None,
    per_class: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble a run's summary.

    Args:
        mode: ``weighted-sync``, ``equal-sync``, ``async`` or ``ddp``.
        model, dataset: what was trained on what.
        wall_time_s: seconds from start to the summary.
        train_time_s: wall time minus start-up and evaluation.
        steps, epochs, samples_seen: how far training went.
        evals: every ``eval`` record; the final scores are those of the highest version.
        target_oa, time_to_target_s: the target and the training time it was first reached
            (None when not reached).
        workers: one entry per worker (``name``, ``slowdown``, ``speed``, ``samples``,
            ``pushes`` at least).
        staleness: ``{"mean", "max"}`` in async mode, None in sync modes.
        finish_reason: why training ended.
        global_batch: B.
        idle_share: sync modes: the share of worker round time spent waiting at the barrier.
        per_class: ``{"names", "accuracy", "support", "confusion"}`` of the final
            evaluation (see ``per_class_of``).
        details: mode-specific extras.

    Returns:
        The summary map, JSON-able; its keys are ``SUMMARY_KEYS`` in that order.
    """
    final = final_eval(evals)
    summary = {
        "mode": mode,
        "model": model,
        "dataset": dataset,
        "wall_time_s": round(wall_time_s, 4),
        "train_time_s": round(max(train_time_s, 0.0), 4),
        "steps": steps,
        "epochs": epochs,
        "samples_seen": samples_seen,
        "final": None if final is None else {k: final[k] for k in SCORE_KEYS},
        "best_oa": max((r["oa"] for r in evals if not r.get("subset")), default=None),
        "target_oa": target_oa,
        "time_to_target_s": None if time_to_target_s is None else round(time_to_target_s, 4),
        "workers": workers,
        "staleness": staleness,
        "idle_share": None if idle_share is None else round(idle_share, 4),
        "per_class": per_class,
        "finish_reason": finish_reason,
        "global_batch": global_batch,
        "details": details or {},
    }
    if tuple(summary)[: len(SUMMARY_KEYS)] != SUMMARY_KEYS:  # this map and SUMMARY_KEYS agree
        raise RuntimeError(f"summary keys {tuple(summary)} do not start with {SUMMARY_KEYS}")
    return summary
