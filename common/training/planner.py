"""Split a global batch over workers in proportion to their measured speeds."""

from __future__ import annotations

import math


def plan_batches(speeds: dict[int, float], total: int) -> dict[int, int]:
    """Batch sizes proportional to speed that sum to ``total``.

    Uses largest remainders, and gives every worker at least one sample when
    ``total >= len(speeds)``; otherwise the fastest ``total`` workers get one each.

    Args:
        speeds: worker id -> samples per second (> 0).
        total: the global batch to split (>= 0).

    Returns:
        worker id -> batch size (>= 0), summing to ``total``; ids with 0 are omitted.
    """
    if total <= 0 or not speeds:
        return {}
    order = sorted(speeds, key=lambda w: (-speeds[w], w))
    if total < len(order):
        return {w: 1 for w in order[:total]}
    top = speeds[order[0]]
    relative = {w: speeds[w] / top for w in order}  # in (0, 1]: no overflow for any input
    norm = math.fsum(relative.values())
    shares = {w: total * relative[w] / norm for w in order}
    sizes = {w: math.floor(shares[w]) for w in order}
    left = total - sum(sizes.values())
    by_remainder = sorted(order, key=lambda w: (-(shares[w] - sizes[w]), w))
    for w in by_remainder[:left]:
        sizes[w] += 1
    for w in order:  # every worker takes part: lend one sample from the largest batch
        if sizes[w] == 0:
            largest = max(order, key=lambda v: (sizes[v], -v))
            sizes[largest] -= 1
            sizes[w] = 1
    return sizes


def plan_equal(workers: list[int], total: int) -> dict[int, int]:
    """Equal batch sizes (differing by at most one) that sum to ``total``."""
    return plan_batches({w: 1.0 for w in workers}, total)
