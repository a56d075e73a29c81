"""What ``summary.json`` and ``pserver status`` report about a run."""

from __future__ import annotations

from typing import Any

from common.data.dataset import DatasetMeta
from common.training.summary import SCORE_KEYS, per_class_of, run_summary
from pserver.context import RunBooks, RunContext
from pserver.evaluation import EvalScheduler
from pserver.snapshots.snapshot_hooks import SnapshotHook
from pserver.store.stores import ParameterStores
from pserver.updates import GradientGuard


class StatusView:
    """Reads the run's parts into the summary and the live status; changes nothing.

    Args:
        context: the run (its configuration, record and the run log's clock).
        books: the epoch under way, the workers, the policy's figures, version and counters.
        meta: the dataset's description (class names).
        stores: where the parameters live (shard addresses, ranges, health).
        guard: refused and clipped pushes.
        evaluations: skipped evaluations.
        snapshots: the snapshot writer's counters.
    """

    def __init__(
        self,
        context: RunContext,
        books: RunBooks,
        *,
        meta: DatasetMeta,
        stores: ParameterStores,
        guard: GradientGuard,
        evaluations: EvalScheduler,
        snapshots: SnapshotHook,
    ) -> None:
        self.config, self.run, self.log = context.config, context.run, context.log
        self.updater, self.roster = books.updater, books.roster
        self.policy, self.sampler = books.policy, books.sampler
        self.meta, self.stores, self.guard = meta, stores, guard
        self.evaluations, self.snapshots = evaluations, snapshots

    def summary(self) -> dict[str, Any]:
        """The run summary (docs/run-files.md), plus mode-specific extras under ``details``."""
        cfg, run = self.config, self.run
        now = self.log.now()
        return run_summary(
            mode=cfg.mode,
            model=cfg.model,
            dataset=str(cfg.dataset),
            wall_time_s=now,
            train_time_s=run.train_time(now),
            steps=self.updater.steps,
            epochs=run.epochs_done,
            samples_seen=self.updater.samples_applied,
            evals=run.evals,
            target_oa=cfg.target_oa,
            time_to_target_s=run.time_to_target,
            workers=[
                w if cfg.is_sync else {**w, "idle_s": None}  # no barrier in async mode
                for w in self.roster.summaries()
            ],
            staleness=self.policy.staleness(),
            idle_share=self.policy.idle_share(),
            finish_reason=run.finish_reason,
            global_batch=cfg.global_batch,
            per_class=per_class_of(run.evals, self.meta.class_names),
            details={
                **self.policy.summary(),
                "shards": cfg.shards,
                "wire_dtype": cfg.wire_dtype,
                "refused_pushes": self.guard.refused,
                "clipped_pushes": self.guard.clipped,
                "skipped_evaluations": self.evaluations.skipped,
                "snapshots": self.snapshots.summary(),
                "error": run.error or None,
            },
        )

    def status(self) -> dict[str, Any]:
        """The live status map answered to ``pserver status``."""
        run = self.run
        last = run.evals[-1] if run.evals else None
        stores = self.stores
        started = run.started
        return {
            "mode": self.config.mode,
            "model": self.config.model,
            "version": self.updater.version,
            "epoch": self.sampler.epoch if started else 0,  # the epoch under way; 0: not started
            "epochs_done": run.epochs_done,
            "steps": self.updater.steps,
            "samples_seen": self.updater.samples_applied,
            "training": run.training,
            "finished": run.finished,
            "finish_reason": run.finish_reason or None,
            "waiting_for": 0 if started else max(self.config.workers - len(self.roster.ready()), 0),
            "last_eval": None
            if last is None
            else {
                **{k: last[k] for k in SCORE_KEYS},
                **{k: last.get(k) for k in ("test_samples", "subset")},
            },
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
                {"id": w.worker_id, "ready": w.ready, **w.summary()}
                for w in self.roster.workers.values()
            ],
        }
