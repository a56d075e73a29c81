"""equal-sync: equal local batches and the plain mean of gradients (the DDP-like baseline)."""

from __future__ import annotations

from common.training.planner import plan_equal
from pserver.membership import WorkerInfo
from pserver.policies.sync_rounds import SyncRounds


class EqualSync(SyncRounds):
    """b_i = B / N; g = mean_i g_i; every round waits for the slowest worker."""

    name = "equal-sync"

    def batch_sizes(self, workers: list[WorkerInfo], total: int) -> dict[int, int]:
        return plan_equal([w.worker_id for w in workers], total)

    def weights(self, sizes: dict[int, int]) -> dict[int, float]:
        return {w: 1.0 / len(sizes) for w in sizes}
