"""weighted-sync: local batches proportional to speed, gradients weighted by batch share."""

from __future__ import annotations

from common.training.planner import plan_batches
from pserver.membership import WorkerInfo
from pserver.policies.sync_rounds import SyncRounds


class WeightedSync(SyncRounds):
    """b_i proportional to s_i with sum B; g = sum_i (b_i / B) g_i, one global-batch step."""

    name = "weighted-sync"

    def batch_sizes(self, workers: list[WorkerInfo], total: int) -> dict[int, int]:
        return plan_batches({w.worker_id: w.speed for w in workers}, total)

    def weights(self, sizes: dict[int, int]) -> dict[int, float]:
        total = sum(sizes.values())
        return {w: n / total for w, n in sizes.items()}
