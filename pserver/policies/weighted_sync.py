"""weighted-sync: local batches planned on fitted performance models (or speeds), gradients
weighted by batch share."""

from __future__ import annotations

import dataclasses

from common.training.planner import plan_batches, plan_by_model
from pserver.membership import WorkerInfo
from pserver.policies.sync_rounds import SyncRounds

PROBE_EVERY = 20  # rounds after which a worker planned at 0 samples gets one sample again


class WeightedSync(SyncRounds):
    """b_i equalising predicted round times (``--planner model``; ``compute`` leaves out
    transfer time) or proportional to speed (``--planner speed``, and until every worker has
    a fitted model), with sum B;
    g = sum_i (b_i / B) g_i, one global-batch step."""

    name = "weighted-sync"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.idle_rounds: dict[int, int] = {}  # worker id -> rounds planned at 0 in a row

    def batch_sizes(self, workers: list[WorkerInfo], total: int) -> dict[int, int]:
        speeds = {w.worker_id: w.speed for w in workers}
        if self.config.planner == "speed":
            return plan_batches(speeds, total)
        fits = {w.worker_id: w.perf.fit() for w in workers}
        if any(f is None for f in fits.values()):
            return plan_batches(speeds, total)
        if self.config.planner == "compute":  # the same model without transfer time
            fits = {w: dataclasses.replace(f, transfer_s=0.0) for w, f in fits.items() if f}
        probe = [w for w, n in self.idle_rounds.items() if n >= PROBE_EVERY and w in fits]
        sizes = plan_by_model(fits, total, probe)  # type: ignore[arg-type]
        if sizes is None:
            return plan_batches(speeds, total)
        self.idle_rounds = {w: self.idle_rounds.get(w, 0) + 1 for w in fits if not sizes.get(w)}
        return sizes

    def weights(self, sizes: dict[int, int]) -> dict[int, float]:
        total = sum(sizes.values())
        return {w: n / total for w, n in sizes.items()}
