"""weighted-sync: local batches planned on fitted performance models (or speeds), gradients
weighted by batch share."""

from __future__ import annotations

import dataclasses

from common.protocol.messages import PushRequest
from common.training.planner import WeightedPlanner
from pserver.config import ServerConfig
from pserver.membership import Task, WorkerInfo
from pserver.policies.base import Decision, Update
from pserver.policies.sync_rounds import SyncRounds
from pserver.roundtiming import RoundTiming

BATCHNORM_MIN_LOCAL_BATCH = 8  # default --min-local-batch for models with BatchNorm


def resolve_min_local_batch(config: ServerConfig, batchnorm: bool) -> ServerConfig:
    """``config`` with ``--min-local-batch`` decided when it was not given: for weighted-sync
    and a model with BatchNorm, ``BATCHNORM_MIN_LOCAL_BATCH`` (at most B / workers, so every
    worker can still take part); otherwise 1 (any local batch).

    Args:
        config: the server's configuration.
        batchnorm: whether the model contains BatchNorm layers.

    Returns:
        The configuration with ``min_local_batch`` set.
    """
    if config.min_local_batch is not None:
        return config
    minimum = 1
    if config.mode == "weighted-sync" and batchnorm:
        minimum = max(1, min(BATCHNORM_MIN_LOCAL_BATCH, config.global_batch // config.workers))
    return dataclasses.replace(config, min_local_batch=minimum)


class WeightedSync(SyncRounds):
    """b_i equalising predicted round times (``--planner model``; ``compute`` leaves out
    transfer time) or proportional to speed (``--planner speed``, and until every worker has
    a fitted model), with sum B;
    g = sum_i (b_i / B) g_i, one global-batch step. The model planner also weighs the measured
    spread of round times (``--plan-spread``): a worker that adds more wait than it saves sits
    out. A worker whose share would fall below ``--min-local-batch`` sits out too. Workers
    planned at 0 are probed now and then with the minimum local batch, and again at once
    while their probes run far faster than their model predicts (a recovery)."""

    name = "weighted-sync"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        cfg, minimum = self.config, self.config.min_local_batch or 1
        self.planner = WeightedPlanner(
            planner=cfg.planner, plan_spread=cfg.plan_spread, min_batch=minimum
        )

    def decide(
        self, worker: WorkerInfo, task: Task, push: PushRequest, version: int, clip: float
    ) -> Decision:
        decision = super().decide(worker, task, push, version, clip)
        if decision.update is None and self.config.planner != "speed":
            worker.perf.refresh()  # while the round waits
        return decision

    def batch_sizes(self, workers: list[WorkerInfo], total: int) -> dict[int, int]:
        speeds = {w.worker_id: w.speed for w in workers}
        fits = {w.worker_id: w.perf.fit(refit=False) for w in workers}
        # a run of faster steps under way: probe again at once to make (or break) the change
        faster = [w.worker_id for w in workers if (run := w.perf.compute_shift.run) and run[0] < 1]
        return self.planner.plan(speeds, fits, total, faster)

    def applied(self, update: Update, timing: RoundTiming | None = None) -> None:
        super().applied(update, timing)
        timing = self.last_timing
        if timing is None or update.clock is None:
            return
        steady = [
            part
            for worker in {w.worker_id: w for w, _, _ in update.entries}.values()  # once each
            if worker.worker_id in update.clock.steady
            and (part := timing.workers.get(worker.worker_id)) is not None
            and part.predicted_s is not None
        ]
        self.planner.spread.add_round(
            [t.actual_s for t in steady], [t.predicted_s or 0.0 for t in steady]
        )

    def summary(self) -> dict[str, object]:
        if not self.planner.uses_spread:
            return super().summary()
        return {**super().summary(), "round_spread_s": round(self.planner.spread.sigma_s(), 6)}

    def weights(self, sizes: dict[int, int]) -> dict[int, float]:
        total = sum(sizes.values())
        return {w: n / total for w, n in sizes.items()}
