"""The model planner against a direct implementation of its rules: the same plan, exactly.

The reference re-plans from scratch after every step (water-filling drops one member and sums
over the rest again, the spread rule drops one member and re-plans), as the rules read; the
planner reaches the same integers with arrays and exact running sums.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Collection, Mapping

import pytest

from common.training.perfmodel import MAX_SECONDS, Fit
from common.training.planner import _usable, expected_max_deviate, plan_by_model


def _finish_time(fits: Mapping[int, Fit], workers: Collection[int], total: float) -> float:
    inverse = math.fsum(1.0 / fits[w].beta_s_per_sample for w in workers)
    lifted = math.fsum(
        (fits[w].alpha_s + fits[w].transfer_s) / fits[w].beta_s_per_sample for w in workers
    )
    return (total + lifted) / inverse


def _expected_round_s(fits: Mapping[int, Fit], sizes: Mapping[int, int], spread: float) -> float:
    latest = max(fits[w].predict(n) for w, n in sizes.items())
    return latest + spread * expected_max_deviate(len(sizes))


def _equal_finish(fits: Mapping[int, Fit], total: int) -> dict[int, int]:
    def one(w: int) -> float:
        return fits[w].predict(1)

    if total < len(fits):
        return {w: 1 for w in sorted(fits, key=lambda w: (one(w), w))[:total]}
    active = set(fits)
    fixed: dict[int, int] = {}
    left = total
    while active:
        finish = _finish_time(fits, active, left)
        short = [w for w in active if one(w) > finish]
        if not short:
            break
        worst = max(short, key=lambda w: (one(w), w))
        active.discard(worst)
        if not active:
            active.add(worst)
            break
        if one(worst) <= _finish_time(fits, active, left):
            fixed[worst] = 1
            left -= 1
    sizes = dict(fixed)
    finish = _finish_time(fits, active, left)
    for w in active:
        fit = fits[w]
        share = (finish - fit.alpha_s - fit.transfer_s) / fit.beta_s_per_sample
        sizes[w] = max(1, min(left, math.floor(share + 1e-9)))
    for _ in range(sum(sizes.values()) - total):
        largest = max(sizes, key=lambda w: (fits[w].predict(sizes[w]), w))
        sizes[largest] -= 1
    heap = [(fits[w].predict(n + 1), w) for w, n in sizes.items()]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes.values())):
        _, w = heapq.heappop(heap)
        sizes[w] += 1
        heapq.heappush(heap, (fits[w].predict(sizes[w] + 1), w))
    return {w: n for w, n in sizes.items() if n > 0}


def reference_plan(
    fits: Mapping[int, Fit], total: int, probe: Collection[int] = (), spread_s: float = 0.0
) -> dict[int, int] | None:
    """``plan_by_model`` as its rules read, one re-plan per step."""
    if not all(_usable(f) for f in fits.values()):
        return None
    if total <= 0 or not fits:
        return {}
    sizes = _equal_finish(fits, total)
    if math.isfinite(spread_s) and 0 < spread_s <= MAX_SECONDS:
        expected = _expected_round_s(fits, sizes, spread_s)
        while len(sizes) > 1:
            smallest = min(sizes, key=lambda w: (sizes[w], -fits[w].predict(1), -w))
            fewer = _equal_finish({w: fits[w] for w in sizes if w != smallest}, total)
            sooner = _expected_round_s(fits, fewer, spread_s)
            if sooner >= expected:
                break
            sizes, expected = fewer, sooner
    for w in sorted(probe):
        if w in fits and not sizes.get(w):
            donor = max(sizes, key=lambda v: (sizes[v] > 1, fits[v].predict(sizes[v]), v))
            if sizes[donor] > 1:
                sizes[donor] -= 1
                sizes[w] = 1
    return sizes


def _random_cluster(rng: random.Random, n: int) -> dict[int, Fit]:
    """Node groups with shared models (ties), scattered speeds, and now and then a worker so
    slow that one sample outlasts the round."""
    groups = [
        Fit(
            rng.choice([0.0, rng.uniform(0, 0.02)]),
            10 ** rng.uniform(-4, -2),
            rng.choice([0.0, rng.uniform(0, 0.05)]),
        )
        for _ in range(rng.randint(1, 4))
    ]
    ids = rng.sample(range(10 * n + 10), n)  # ids in no particular order
    fits = {}
    for w in ids:
        base = rng.choice(groups)
        roll = rng.random()
        if roll < 0.4:
            fits[w] = base
        elif roll < 0.9:
            scale = rng.lognormvariate(0, 0.3)
            fits[w] = Fit(base.alpha_s, base.beta_s_per_sample * scale, base.transfer_s)
        else:
            fits[w] = Fit(rng.uniform(0.1, 2.0), base.beta_s_per_sample, base.transfer_s)
    return fits


def _random_case(rng: random.Random, n: int) -> tuple[dict[int, Fit], int, list[int], float]:
    fits = _random_cluster(rng, n)
    total = rng.choice([0, 1, max(n - 1, 1), n, n + 1, rng.randint(1, 64 * n)])
    probe = [*rng.sample(sorted(fits), rng.randint(0, min(n, 3))), 10**6]  # and an unknown id
    spread = rng.choice([0.0, math.nan, 1e-4, 1e-3, 5e-3, 0.02, 0.2])
    return fits, total, probe, spread


def test_the_plan_is_the_reference_plan_on_random_clusters() -> None:
    rng = random.Random(20261125)
    dropped = probed = 0
    for case in range(600):
        fits, total, probe, spread = _random_case(rng, rng.randint(1, 24))
        expected = reference_plan(fits, total, probe, spread)
        assert plan_by_model(fits, total, probe, spread) == expected, (case, fits, total)
        assert expected is not None
        dropped += 0 < total and len(expected) < min(len(fits), total)
        probed += any(w in expected and expected[w] == 1 for w in probe)
    assert dropped > 50 and probed > 50  # the cases reach the spread rule and the probes


@pytest.mark.parametrize("n", [64, 300])
def test_the_plan_is_the_reference_plan_on_large_clusters(n: int) -> None:
    rng = random.Random(n)
    for _ in range(4):
        fits = _random_cluster(rng, n)
        for total, spread in ((32 * n, 0.0), (32 * n, 0.005), (8 * n, 0.05), (n // 2, 0.01)):
            assert plan_by_model(fits, total, [], spread) == reference_plan(fits, total, [], spread)


def test_the_plan_is_the_reference_plan_on_edge_cases() -> None:
    one = Fit(0.001, 0.001, 0.002)
    cases: list[tuple[dict[int, Fit], int, list[int], float]] = [
        ({}, 64, [], 0.01),
        ({7: one}, 0, [7], 0.01),
        ({7: one}, 5, [7, 8], 0.01),
        ({1: one, 2: one, 3: one}, 2, [3], 0.01),  # fewer samples than workers
        ({w: one for w in range(5)}, 5, [], 0.5),  # one sample each, then the spread rule
        ({1: one, 2: Fit(50.0, 0.001, 0.0)}, 64, [2], 0.0),  # hopeless: zero, then a probe
        ({1: one, 2: Fit(50.0, 0.001, 0.0)}, 1, [2], 0.0),  # a probe without a donor
        ({1: Fit(0.0, 1e-9, 0.0), 2: Fit(99_000.0, 99_000.0, 0.0)}, 100_000, [], 0.0),
        ({1: one, 2: Fit(math.nan, 0.001, 0.0)}, 64, [], 0.01),  # unusable: None
        ({w: Fit(0.0, 0.001 * (1 + w % 3), 0.0) for w in range(40)}, 64, [39], MAX_SECONDS),
    ]
    for fits, total, probe, spread in cases:
        assert plan_by_model(fits, total, probe, spread) == reference_plan(
            fits, total, probe, spread
        ), (fits, total, probe, spread)
