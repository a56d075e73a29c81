"""Split a global batch over workers: by fitted performance models, or by measured speeds.

The model planner (``plan_by_model``) gives worker i the batch b_i for which every worker's
predicted round time alpha_i + beta_i*b_i + c_i is the same, with sum b_i = B. A worker gets 0
samples when even one sample would make it finish after the round the others finish without
it (alpha_i + beta_i + c_i > T without i); the caller re-probes such a worker now and then.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping

from common.training.perfmodel import MAX_SECONDS, Fit


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


def _usable(fit: Fit) -> bool:
    fixed = fit.alpha_s + fit.transfer_s
    return (
        all(math.isfinite(v) for v in (fit.alpha_s, fit.beta_s_per_sample, fit.transfer_s))
        and fit.alpha_s >= 0
        and fit.transfer_s >= 0
        and fixed <= MAX_SECONDS
        and 0 < fit.beta_s_per_sample <= MAX_SECONDS
    )


def _finish_time(fits: Mapping[int, Fit], workers: Collection[int], total: float) -> float:
    """T with sum over ``workers`` of (T - fixed_i) / beta_i == ``total``."""
    inverse = math.fsum(1.0 / fits[w].beta_s_per_sample for w in workers)
    lifted = math.fsum(
        (fits[w].alpha_s + fits[w].transfer_s) / fits[w].beta_s_per_sample for w in workers
    )
    return (total + lifted) / inverse


def plan_by_model(
    fits: Mapping[int, Fit], total: int, probe: Collection[int] = ()
) -> dict[int, int] | None:
    """Batch sizes that equalise predicted round times, summing to ``total``.

    Continuous sizes come from water-filling (workers whose one-sample time exceeds the
    round time without them get 0, see the module docstring); they are floored and the
    samples left go one at a time to the worker that would then finish first, so the
    predicted round time (the largest) is as small as integers allow.

    Args:
        fits: worker id -> fitted model.
        total: the global batch (>= 0).
        probe: workers to give at least one sample even if the plan gives them none (the
            sample is taken from the worker predicted to finish last).

    Returns:
        worker id -> batch size (ids with 0 omitted), or None when a model is unusable (not
        finite, negative, or beyond ``MAX_SECONDS``): the caller then plans by speed.
    """
    if not all(_usable(f) for f in fits.values()):
        return None
    if total <= 0 or not fits:
        return {}

    def one(w: int) -> float:
        return fits[w].predict(1)

    if total < len(fits):  # not enough for everyone: one each to the quickest
        return {w: 1 for w in sorted(fits, key=lambda w: (one(w), w))[:total]}
    active = set(fits)
    fixed: dict[int, int] = {}
    left = total
    while active:
        finish = _finish_time(fits, active, left)
        short = [w for w in active if fits[w].predict(1) > finish]  # share below one sample
        if not short:
            break
        worst = max(short, key=lambda w: (one(w), w))
        active.discard(worst)
        if not active:  # the last worker planned continuously takes the rest
            active.add(worst)
            break
        if one(worst) <= _finish_time(fits, active, left):
            fixed[worst] = 1  # one sample keeps it within the others' round
            left -= 1
    sizes = dict(fixed)
    if active:
        finish = _finish_time(fits, active, left)
        for w in active:
            fit = fits[w]
            share = (finish - fit.alpha_s - fit.transfer_s) / fit.beta_s_per_sample
            sizes[w] = max(1, min(left, math.floor(share + 1e-9)))
    over = sum(sizes.values()) - total
    while over > 0:  # rounding guard: only reached through float noise
        largest = max(sizes, key=lambda w: (fits[w].predict(sizes[w]), w))
        sizes[largest] -= 1
        over -= 1
    heap = [(fits[w].predict(n + 1), w) for w, n in sizes.items()]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes.values())):
        _, w = heapq.heappop(heap)
        sizes[w] += 1
        heapq.heappush(heap, (fits[w].predict(sizes[w] + 1), w))
    for w in sorted(probe):
        if w in fits and not sizes.get(w):
            donor = max(sizes, key=lambda v: (sizes[v] > 1, fits[v].predict(sizes[v]), v))
            if sizes[donor] > 1:
                sizes[donor] -= 1
                sizes[w] = 1
    return {w: n for w, n in sizes.items() if n > 0}
