"""How long one call of the model planner takes at 4, 64 and 1024 workers: the planner against
the step-by-step reference (re-plan after every dropped member, as its rules read; the one in
tests/common/test_planner_reference.py), side by side in one run.

The cluster is the one of bench/simulate_speed.py: three node groups in a 1 : 1 : 2 ratio at
0.75, 1.7 and 4.8 ms per sample, 5 ms per step, a global batch of 32 per worker. The cases, the
refits and the replay of changes of speed are described in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from bench.harness.record import parse_settings
from common.training.perfmodel import MAX_CALIBRATION, WINDOW, Fit, PerfModel
from common.training.planner import plan_by_model
from tests.common.test_planner_reference import reference_plan

PER_SAMPLE_S = (0.00075, 0.0017, 0.0048, 0.0048)  # groups in a 1 : 1 : 2 ratio
FIXED_S = 0.005
BATCH_PER_WORKER = 32
SPREAD_SHARE = 1.0
CASES = ("steady", "spread", "links")
CALIBRATION_BATCHES = (8, 16, 32, 64)
NOISE = 0.05  # relative spread of a measured time
FOLLOW_WORKERS = 4  # the change replay: B = 128
FOLLOW_ROUNDS = 40  # rounds of each phase
FOLLOW_JITTER = 0.1  # relative spread of a measured time
FOLLOW_TOLERANCE = 0.1  # a share within this (relative) of the new one has followed
SLOWER, STALL, STALL_ROUND = 8.0, 10.0, 4


def cluster(n: int, case: str, seed: int = 0) -> tuple[dict[int, Fit], float]:
    """The bench's ``n`` workers for a case, and the spread to plan with."""
    rng = random.Random(seed)
    outside = (0.5, 10.0) if case == "links" else (0.020, 0.025)
    fits = {}
    for w in range(n):
        beta = PER_SAMPLE_S[w % len(PER_SAMPLE_S)]
        if w % len(PER_SAMPLE_S) >= 2:
            beta *= rng.lognormvariate(0.0, 0.05)
        fits[w] = Fit(FIXED_S, beta, rng.uniform(*outside))
    predicted = max(f.predict(BATCH_PER_WORKER) for f in fits.values())
    return fits, SPREAD_SHARE * predicted if case == "spread" else 0.0


def _measured(seconds: float, rng: random.Random) -> float:
    return seconds * rng.uniform(1 - NOISE, 1 + NOISE)


def _push(model: PerfModel, fit: Fit, rng: random.Random) -> None:
    batch = BATCH_PER_WORKER + rng.randint(-2, 2)
    model.add_compute(batch, _measured(fit.alpha_s + fit.beta_s_per_sample * batch, rng))
    model.add_transfer(_measured(fit.transfer_s, rng))


def speed_models(fits: dict[int, Fit], seed: int = 0) -> list[tuple[PerfModel, Fit]]:
    """Each worker's speed model with a full window of measurements of its fit."""
    rng = random.Random(seed)
    models = []
    for fit in fits.values():
        model = PerfModel()
        batches = [
            b
            for _ in range(MAX_CALIBRATION // len(CALIBRATION_BATCHES))
            for b in CALIBRATION_BATCHES
        ]
        model.seed(
            batches, [_measured(fit.alpha_s + fit.beta_s_per_sample * b, rng) for b in batches]
        )
        for _ in range(WINDOW):
            _push(model, fit, rng)
        model.fit()
        models.append((model, fit))
    return models


def round_refits_s(models: list[tuple[PerfModel, Fit]], rng: random.Random) -> float:
    """Seconds to refit every model after one more push each (the pushes not timed)."""
    for model, fit in models:
        _push(model, fit, rng)
    began = time.perf_counter()
    for model, _ in models:
        model.fit()
    return time.perf_counter() - began


def replay(factors: list[float]) -> list[tuple[int, int]]:
    """Worker 0's planned batch before each round of the change replay, where its compute takes
    ``factors[r]`` times as long in round r, and the same for twin models that also see its
    push of round ``STALL_ROUND`` take ``STALL`` times as long."""
    fits = cluster(FOLLOW_WORKERS, "steady")[0]
    twins = [[m for m, _ in speed_models(fits)] for _ in range(2)]
    rng, batches = random.Random(2), []
    for r, factor in enumerate(factors):
        fitted = [dict(enumerate(m.refresh() for m in t)) for t in twins]  # all fitted
        plain, seen = (plan_by_model(f, 128) or {} for f in fitted)  # type: ignore[arg-type]
        batches.append((plain[0], seen.get(0, 0)))
        for w, b in plain.items():
            compute, transfer = (
                rng.uniform(1 - FOLLOW_JITTER, 1 + FOLLOW_JITTER) for _ in range(2)
            )
            compute *= (fits[w].alpha_s + fits[w].beta_s_per_sample * b) * (factor if w == 0 else 1)
            stalls = (1, STALL if (r, w) == (STALL_ROUND, 0) else 1)
            for models, stall in zip(twins, stalls, strict=True):
                models[w].add_compute(b, compute * stall)
                models[w].add_transfer(fits[w].transfer_s * transfer)
    return batches


def follow_figures() -> tuple[int, int, float]:
    """``pushes_to_follow_slowdown``, ``pushes_to_follow_speedup`` and ``stall_plan_shift``."""
    n, fits = FOLLOW_ROUNDS, cluster(FOLLOW_WORKERS, "steady")[0]
    plain, seen = zip(*replay([1.0] * n + [SLOWER] * n + [1.0] * n), strict=True)
    follows = []
    for factor, batches in ((SLOWER, plain[n : 2 * n]), (1.0, plain[2 * n :])):
        scaled = Fit(
            fits[0].alpha_s * factor, fits[0].beta_s_per_sample * factor, fits[0].transfer_s
        )
        target = (plan_by_model({**fits, 0: scaled}, 128) or {})[0]
        off = [k for k, b in enumerate(batches) if abs(b - target) > FOLLOW_TOLERANCE * target]
        follows.append(off[-1] + 1 if off else 0)
    after = slice(STALL_ROUND + 1, n)
    stall = max(abs(s / p - 1) for p, s in zip(plain[after], seen[after], strict=True))
    return follows[0], follows[1], stall


Planner = Callable[[dict[int, Fit], int, tuple[int, ...], float], dict[int, int] | None]


def _time_call(
    plan: Planner, fits: dict[int, Fit], total: int, spread: float
) -> tuple[float, dict[int, int] | None]:
    began = time.perf_counter()
    result = plan(fits, total, (), spread)
    return time.perf_counter() - began, result


def main(argv: list[str] | None = None) -> int:
    """Time both planners per cluster size and case; print the table and the figures."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", default="4,64,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--follow-only", action="store_true", help="only the change replay")
    args = parse_settings(parser, argv)
    slower, faster, stall = follow_figures()
    print(f"worker 0 {SLOWER:g}x slower: plan followed after {slower} pushes; back: {faster}; "
          f"one {STALL:g}x stall moved its batch by {100 * stall:.1f} %")  # fmt: skip
    print(f"pushes_to_follow_slowdown={slower}")
    print(f"pushes_to_follow_speedup={faster}")
    print(f"stall_plan_shift={stall:.4f}")
    if args.follow_only:
        return 0
    print(f"{'workers':>7} {'case':>6} {'members':>7} {'reference ms':>12} "
          f"{'planner ms':>10} {'ratio':>7}")  # fmt: skip
    for n in (int(v) for v in args.workers.split(",")):
        total = BATCH_PER_WORKER * n
        for case in CASES:
            fits, spread = cluster(n, case)
            ours, theirs = [], []
            plan: dict[int, int] | None = None
            for _ in range(args.repeats):  # interleaved: the same load for both
                took_ref, expected = _time_call(reference_plan, fits, total, spread)
                took, plan = _time_call(plan_by_model, fits, total, spread)
                if plan != expected:
                    raise SystemExit(f"{n} workers, {case}: the plans differ")
                theirs.append(took_ref)
                ours.append(took)
            ref_ms = 1e3 * statistics.median(theirs)
            our_ms = 1e3 * statistics.median(ours)
            members = len(plan or {})
            print(f"{n:7d} {case:>6} {members:7d} {ref_ms:12.2f} {our_ms:10.2f} "
                  f"{ref_ms / our_ms:6.1f}x")  # fmt: skip
            print(f"reference_{n}_{case}_ms={ref_ms:.3f}")
            print(f"planner_{n}_{case}_ms={our_ms:.3f}")
        models, rng = speed_models(cluster(n, "steady")[0]), random.Random(1)
        refit_ms = 1e3 * statistics.median(round_refits_s(models, rng) for _ in range(args.repeats))
        print(f"{n:7d} one round's refits of the speed models: {refit_ms:.2f} ms")
        print(f"refit_{n}_ms={refit_ms:.3f}")
    return 0
