"""Split a global batch over workers: by fitted performance models, or by measured speeds.

The model planner (``plan_by_model``) gives worker i the batch b_i for which every worker's
predicted round time alpha_i + beta_i*b_i + c_i is the same, with sum b_i = B. A worker gets 0
samples when even one sample would make it finish after the round the others finish without
it (alpha_i + beta_i + c_i > T without i); the caller re-probes such a worker now and then.

Round times scatter around their predictions (a busy core, a GC pause), and a round waits for
its slowest member, so each member adds to the expected round time: with n members whose times
scatter independently by sigma, the round ends about sigma * E[max of n standard normals] after
the predicted time. Given that spread (``spread_s``), the planner drops the member with the
smallest batch while the plan without it is expected to end sooner: a worker whose share
shortens the predicted round by less than the wait it adds sits out (and is re-probed too).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Collection, Mapping

import numpy as np

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


@functools.cache
def expected_max_deviate(n: int) -> float:
    """E[max of n independent standard normal deviates] (0 for n <= 1): 0.564 for 2, 0.846
    for 3, 1.029 for 4."""
    if n <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 3601)
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    density = n * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * cdf ** (n - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


def expected_round_s(fits: Mapping[int, Fit], sizes: Mapping[int, int], spread_s: float) -> float:
    """The predicted round time of a plan plus the expected wait for its slowest member."""
    if not sizes:
        return 0.0
    latest = max(fits[w].predict(n) for w, n in sizes.items())
    return latest + spread_s * expected_max_deviate(len(sizes))


def plan_by_model(
    fits: Mapping[int, Fit], total: int, probe: Collection[int] = (), spread_s: float = 0.0
) -> dict[int, int] | None:
    """Batch sizes that equalise predicted round times, summing to ``total``.

    Continuous sizes come from water-filling (workers whose one-sample time exceeds the
    round time without them get 0, see the module docstring); they are floored and the
    samples left go one at a time to the worker that would then finish first, so the
    predicted round time (the largest) is as small as integers allow. With a ``spread_s``,
    members are then dropped, smallest batch first, while that lowers ``expected_round_s``.

    Args:
        fits: worker id -> fitted model.
        total: the global batch (>= 0).
        probe: workers to give at least one sample even if the plan gives them none (the
            sample is taken from the worker predicted to finish last).
        spread_s: how much round times scatter independently around their predictions (one
            standard deviation, seconds); 0 (or not finite) plans on predictions alone.

    Returns:
        worker id -> batch size (ids with 0 omitted), or None when a model is unusable (not
        finite, negative, or beyond ``MAX_SECONDS``): the caller then plans by speed.
    """
    if not all(_usable(f) for f in fits.values()):
        return None
    if total <= 0 or not fits:
        return {}
    sizes = _equal_finish(fits, total)
    if math.isfinite(spread_s) and 0 < spread_s <= MAX_SECONDS:
        sizes = _without_stragglers(fits, total, sizes, spread_s)
    for w in sorted(probe):
        if w in fits and not sizes.get(w):
            donor = max(sizes, key=lambda v: (sizes[v] > 1, fits[v].predict(sizes[v]), v))
            if sizes[donor] > 1:
                sizes[donor] -= 1
                sizes[w] = 1
    return sizes


def _without_stragglers(
    fits: Mapping[int, Fit], total: int, sizes: dict[int, int], spread_s: float
) -> dict[int, int]:
    """Drop the member with the smallest batch (the slower on a tie) while the plan without
    it has a lower ``expected_round_s``."""
    expected = expected_round_s(fits, sizes, spread_s)
    while len(sizes) > 1:
        smallest = min(sizes, key=lambda w: (sizes[w], -fits[w].predict(1), -w))
        fewer = _equal_finish({w: fits[w] for w in sizes if w != smallest}, total)
        sooner = expected_round_s(fits, fewer, spread_s)
        if sooner >= expected:
            break
        sizes, expected = fewer, sooner
    return sizes


def _equal_finish(fits: Mapping[int, Fit], total: int) -> dict[int, int]:
    """``plan_by_model`` without spread or probes, for usable ``fits`` and ``total`` > 0."""

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
    return {w: n for w, n in sizes.items() if n > 0}
