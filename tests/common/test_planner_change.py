"""Change points of the performance model against hand computations: a lasting change of speed
is followed within a few pushes, a single stall barely moves the plan, noise makes none."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from common.training.perfmodel import (
    MIN_NOISE,
    NOISE_FLOOR_S,
    Fit,
    PerfModel,
    Shift,
    log_ratio,
    log_ratios,
)
from common.training.planner import plan_by_model


def _lifted(measured: float, predicted: float) -> float:
    return math.log((measured + NOISE_FLOOR_S) / (predicted + NOISE_FLOOR_S))


def test_a_measurement_has_the_log_ratio_its_window_gives_it() -> None:
    rng = np.random.default_rng(0)
    measured = np.concatenate([[0.0, 0.0, 1.0, 1e5], rng.uniform(0.0, 2.0, 2000)])
    predicted = np.concatenate([[0.0, -1.0, np.inf, 1e-9], rng.uniform(-0.1, 2.0, 2000)])
    with np.errstate(divide="ignore"):  # an infinite prediction: a ratio of 0
        window = log_ratios(measured, predicted)
        for i, (m, p) in enumerate(zip(measured.tolist(), predicted.tolist(), strict=True)):
            assert log_ratio(m, p) == pytest.approx(window[i], rel=1e-14, abs=1e-15)
        assert log_ratio(1.0, np.inf) == -math.inf and math.isnan(log_ratio(1.0, math.nan))


def test_three_far_measurements_on_one_side_make_a_change_point() -> None:
    shift = Shift()
    shift.sigma = MIN_NOISE  # centre 0: far means a log ratio beyond 4 x 0.05 = 0.2
    assert shift.add(1.3, 1.0) is None and shift.run == [1.3]  # ln 1.3 = 0.26: far
    assert shift.add(1.1, 1.0) is None and shift.run == []  # ln 1.1 = 0.095: near, run over
    assert shift.add(2.0, 1.0) is None and shift.add(0.5, 1.0) is None
    assert shift.run == [0.5]  # far on the other side: a new run
    assert shift.add(0.4, 1.0) is None
    assert shift.add(0.6, 1.0) == 0.5  # the run's median ratio
    assert shift.found == 1 and shift.run == []
    shift.centre = math.log(2.0)  # the window runs at twice the fit's prediction
    assert shift.add(2.0, 1.0) is None and shift.run == []  # at the window's level: near
    assert shift.add(3.0, 1.0) is None and shift.run == [1.5]  # over the level


def test_centre_and_sigma_are_the_median_and_scaled_mad_of_log_ratios() -> None:
    shift = Shift()
    shift.measure(np.array([1.0, 1.2, 0.9, 1.1, 5.0, 1.0, 1.1, 1.2, 0.8]), 1.0)
    # lifted log ratios, sorted: ln .8, ln .9, ln 1, ln 1, ln 1.1, ln 1.1, ln 1.2, ln 1.2, ln 5
    centre = _lifted(1.1, 1.0)
    assert shift.centre == pytest.approx(centre)
    # distances from it, sorted: 0, 0, ln 1.2 - ln 1.1 (twice), ln 1.1 - ln 1 (twice), ...
    assert shift.sigma == pytest.approx(1.4826 * (centre - _lifted(1.0, 1.0)))
    shift.measure(np.array([1.0] * 8), 1.0)
    assert shift.centre == 0.0 and shift.sigma == MIN_NOISE  # no scatter: the floor
    shift.measure(np.array([1.0, 1.2, 0.9, 1.1, 5.0, 1.0, 1.1]), 1.0)
    assert shift.sigma == math.inf  # fewer than CHANGE_MIN_POINTS: nothing is far


def _steady_model() -> tuple[PerfModel, Fit]:
    model = PerfModel()
    model.seed([8, 8, 32, 32], [0.008, 0.008, 0.02, 0.02])  # t = 0.004 + 0.0005 b
    for _ in range(10):
        model.add_compute(32, 0.02)
        model.add_transfer(0.01)
    fit = model.fit()
    assert fit is not None and _terms(fit) == pytest.approx((0.004, 0.0005, 0.01))
    return model, fit


def _terms(fit: Fit | None) -> tuple[float, float, float]:
    assert fit is not None
    return fit.alpha_s, fit.beta_s_per_sample, fit.transfer_s


@pytest.mark.parametrize("factor", [8.0, 1 / 8])
def test_a_lasting_change_is_followed_at_its_third_push(factor: float) -> None:
    model, fit = _steady_model()
    for _ in range(2):
        last = model.fit()
        model.add_compute(32, 0.02 * factor)
        assert model.fit(refit=False) is last  # no change point yet: the plan keeps its fit
    # refitted, the far pushes weigh next to nothing (Huber; the window's scatter is 0)
    assert _terms(model.fit()) == pytest.approx(_terms(fit), rel=1e-4)
    model.add_compute(32, 0.02 * factor)
    # a change point by the factor: every older time (calibration too) is scaled by it, and
    # even a plan that takes the last fit as it is gets the new one
    followed = _terms(model.fit(refit=False))
    assert followed == pytest.approx((0.004 * factor, 0.0005 * factor, 0.01), rel=1e-4)
    assert model.compute_shift.found == 1
    assert model.calibration[0] == (8, pytest.approx(0.008 * factor))


def test_a_lasting_change_of_transfer_time_is_followed_too() -> None:
    model = _steady_model()[0]
    for k in range(3):
        model.add_transfer(0.05)
        assert _terms(model.fit(refit=False))[2] == pytest.approx(0.05 if k == 2 else 0.01)
        model.fit()
    assert model.transfer_shift.found == 1 and model.compute_shift.found == 0


def test_a_single_stall_is_no_change_point() -> None:
    model, fit = _steady_model()
    model.add_compute(32, 0.2)  # one step 10x slower
    model.add_compute(32, 0.02)  # then as before: the run is over
    assert model.compute_shift.run == [] and model.compute_shift.found == 0
    assert _terms(model.fit()) == pytest.approx(_terms(fit))


def _noisy_push(rng: random.Random, batch: int, jitter: float) -> float:
    return (0.005 + 0.001 * batch) * rng.uniform(1 - jitter, 1 + jitter)


def test_a_single_stall_moves_the_plan_by_at_most_ten_percent() -> None:
    """Two workers at 5 ms + 1 ms per sample, 20 ms outside compute, times scattered by 10 %;
    the models of one pair see worker 1's 41st push take 10x its time, their twins do not.
    Worker 1's batch in every later plan stays within 10 % of its twin plan's."""
    rng = random.Random(0)
    seen, blind = ([PerfModel(), PerfModel()] for _ in range(2))
    for pair in (seen, blind):
        for model in pair:
            model.seed([8, 8, 32, 32], [0.013, 0.013, 0.037, 0.037])
    worst = 0.0
    for push in range(80):
        plan = plan_by_model({w: m.fit() or Fit(0, 1, 0) for w, m in enumerate(blind)}, 64)
        other = plan_by_model({w: m.fit() or Fit(0, 1, 0) for w, m in enumerate(seen)}, 64)
        assert plan and other
        worst = max(worst, abs(other[1] - plan[1]) / plan[1])
        for w, b in plan.items():
            compute, transfer = _noisy_push(rng, b, 0.1), 0.02 * rng.uniform(0.9, 1.1)
            for pair, stall in ((seen, 10.0 if push == 40 and w == 1 else 1.0), (blind, 1.0)):
                pair[w].add_compute(b, compute * stall)
                pair[w].add_transfer(transfer)
    assert worst <= 0.1
    assert seen[1].compute_shift.found == 0


@pytest.mark.parametrize(
    ("kind", "jitter"),
    [("uniform", 0.1), ("uniform", 0.2), ("lognormal", 0.1), ("lognormal", 0.2)],
)
def test_a_noisy_steady_worker_makes_no_change_point(kind: str, jitter: float) -> None:
    """500 pushes at batches 28-36 with every time scattered: no change point in 5 seeds
    (none either over 100 seeds; with one time in 20 also stalled 1.5-10x on top of 10 %
    lognormal scatter, 3 in 10,000 pushes: see docs/planner.md)."""
    for seed in range(5):
        rng = random.Random(seed)

        def noise(rng: random.Random = rng) -> float:
            if kind == "uniform":
                return rng.uniform(1 - jitter, 1 + jitter)
            return rng.lognormvariate(0.0, jitter)

        model = PerfModel()
        model.seed([8, 8, 32, 32], [0.013 * noise(), 0.013 * noise(), 0.037 * noise(), 0.037])
        for _ in range(500):
            batch = rng.randint(28, 36)
            model.add_compute(batch, (0.005 + 0.001 * batch) * noise())
            model.add_transfer(0.02 * noise())
            model.fit()
        assert (model.compute_shift.found, model.transfer_shift.found) == (0, 0)
