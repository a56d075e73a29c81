"""What ``summary.json`` and ``pserver status`` report about a server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.training.summary import per_class_of, run_summary, scores_of

if TYPE_CHECKING:
    from pserver.server import ParameterServer


def build_summary(ps: ParameterServer) -> dict[str, Any]:
    """The run summary of GUIDE section 3, plus mode-specific extras under ``details``."""
    cfg, trainer = ps.config, ps.trainer
    train_start = ps.train_start or 0.0
    train_end = ps.train_end if ps.train_end is not None else ps.log.now()
    staleness = ps.policy.staleness() if hasattr(ps.policy, "staleness") else None
    return run_summary(
        mode=cfg.mode,
        model=cfg.model,
        dataset=str(cfg.dataset),
        wall_time_s=ps.log.now(),
        train_time_s=train_end - train_start,
        steps=trainer.steps,
        epochs=ps.epochs_done,
        samples_seen=trainer.samples_applied,
        evals=ps.evals,
        target_oa=cfg.target_oa,
        time_to_target_s=ps.time_to_target,
        workers=ps.roster.summaries(),
        staleness=staleness,
        finish_reason=ps.finish_reason,
        global_batch=cfg.global_batch,
        per_class=per_class_of(ps.evals, ps.meta.class_names),
        details=ps.policy.summary(),
    )


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
        "last_eval": scores_of(last),
        "workers": [
            {"id": w.worker_id, "ready": w.ready, **w.summary()} for w in ps.roster.workers.values()
        ],
    }
