"""What ``summary.json`` and ``pserver status`` report about a server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pserver.server import ParameterServer


def _scores(record: dict[str, Any] | None) -> dict[str, float] | None:
    if record is None:
        return None
    return {k: record[k] for k in ("oa", "aa", "kappa", "loss")}


def build_summary(ps: ParameterServer) -> dict[str, Any]:
    """The run summary of GUIDE section 3, plus mode-specific extras under ``details``."""
    cfg, trainer = ps.config, ps.trainer
    final = max(ps.evals, key=lambda r: r["version"]) if ps.evals else None
    train_start = ps.train_start or 0.0
    train_end = ps.train_end if ps.train_end is not None else ps.log.now()
    staleness = ps.policy.staleness() if hasattr(ps.policy, "staleness") else None
    return {
        "mode": cfg.mode,
        "model": cfg.model,
        "dataset": str(cfg.dataset),
        "wall_time_s": round(ps.log.now(), 4),
        "train_time_s": round(max(train_end - train_start, 0.0), 4),
        "steps": trainer.steps,
        "epochs": ps.epochs_done,
        "samples_seen": trainer.samples_applied,
        "final": _scores(final),
        "best_oa": max((r["oa"] for r in ps.evals), default=None),
        "target_oa": cfg.target_oa,
        "time_to_target_s": None if ps.time_to_target is None else round(ps.time_to_target, 4),
        "workers": ps.roster.summaries(),
        "staleness": staleness,
        "finish_reason": ps.finish_reason,
        "global_batch": cfg.global_batch,
        "details": ps.policy.summary(),
    }


def status_of(ps: ParameterServer) -> dict[str, Any]:
    """The live status map answered to ``pserver status``."""
    last = ps.evals[-1] if ps.evals else None
    return {
        "mode": ps.config.mode,
        "model": ps.config.model,
        "version": ps.trainer.version,
        "epoch": ps.trainer.sampler.epoch,
        "steps": ps.trainer.steps,
        "samples_seen": ps.trainer.samples_applied,
        "training": ps.started and not ps.finished,
        "finished": ps.finished,
        "waiting_for": max(ps.config.workers - len(ps.active_workers()), 0)
        if not ps.started
        else 0,
        "last_eval": _scores(last),
        "workers": [
            {"id": w.worker_id, "ready": w.ready, **w.summary()} for w in ps.roster.workers.values()
        ],
    }
