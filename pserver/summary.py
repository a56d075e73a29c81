"""What ``summary.json`` and ``pserver status`` report about a server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.training.summary import per_class_of, run_summary, scores_of

if TYPE_CHECKING:
    from pserver.server import ParameterServer


def build_summary(ps: ParameterServer) -> dict[str, Any]:
    """The run summary (docs/run-files.md), plus mode-specific extras under ``details``."""
    cfg, run = ps.config, ps.run
    now = ps.log.now()
    return run_summary(
        mode=cfg.mode,
        model=cfg.model,
        dataset=str(cfg.dataset),
        wall_time_s=now,
        train_time_s=run.train_time(now),
        steps=ps.updater.steps,
        epochs=run.epochs_done,
        samples_seen=ps.updater.samples_applied,
        evals=run.evals,
        target_oa=cfg.target_oa,
        time_to_target_s=run.time_to_target,
        workers=[
            w if cfg.is_sync else {**w, "idle_s": None}  # no barrier in async mode
            for w in ps.roster.summaries()
        ],
        staleness=ps.policy.staleness(),
        idle_share=ps.policy.idle_share(),
        finish_reason=run.finish_reason,
        global_batch=cfg.global_batch,
        per_class=per_class_of(run.evals, ps.meta.class_names),
        details={
            **ps.policy.summary(),
            "shards": cfg.shards,
            "wire_dtype": cfg.wire_dtype,
            "refused_pushes": ps.guard.refused,
            "clipped_pushes": ps.guard.clipped,
            "skipped_evaluations": ps.evaluations.skipped,
            "snapshots": None
            if ps.snapshots is None
            else {
                "every": ps.snapshots.every,
                "written": ps.snapshots.written,
                "failed": ps.snapshots.failed,
            },
            "error": run.error or None,
        },
    )


def status_of(ps: ParameterServer) -> dict[str, Any]:
    """The live status map answered to ``pserver status``."""
    run = ps.run
    last = run.evals[-1] if run.evals else None
    stores = ps.stores
    return {
        "mode": ps.config.mode,
        "model": ps.config.model,
        "version": ps.updater.version,
        "epoch": ps.sampler.epoch if ps.started else 0,  # the epoch under way; 0: not started
        "epochs_done": run.epochs_done,
        "steps": ps.updater.steps,
        "samples_seen": ps.updater.samples_applied,
        "training": ps.started and not ps.finished,
        "finished": ps.finished,
        "finish_reason": run.finish_reason or None,
        "waiting_for": 0 if ps.started else max(ps.config.workers - len(ps.roster.ready()), 0),
        "last_eval": scores_of(last),
        "shards": [
            {
                "index": i,
                "address": address or "(this server)",
                "state": [lo, hi],
                **getattr(stores, "health", {}).get(i, {}),
            }
            for i, (address, lo, hi) in enumerate(
                zip(stores.addresses, stores.bounds[:-1], stores.bounds[1:], strict=False)
            )
        ],
        "workers": [
            {"id": w.worker_id, "ready": w.ready, **w.summary()} for w in ps.roster.workers.values()
        ],
    }
