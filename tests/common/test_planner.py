"""The performance model and the model planner against hand computations."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest

from common.errors import ErrorCode, ProtocolError
from common.protocol.messages import (
    WORKER_REQUESTS,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    PushRequest,
    TaskReply,
    TaskRequest,
    parse_message,
)
from common.protocol.tokens import TokenBook, new_key
from common.protocol.wire import PROTOCOL_VERSION, encode_frames
from common.training.perfmodel import REFIT_EVERY, Fit, PerfModel, RoundSpread, robust_line
from common.training.planner import (
    expected_max_deviate,
    plan_batches,
    plan_by_model,
)
from common.training.probes import PROBE_EVERY, PROBE_EVERY_MAX
from pserver.config import ServerConfig
from pserver.membership import Roster, TaskFactory, WorkerInfo
from pserver.policies.weighted_sync import WeightedSync
from pserver.sampler import EpochSampler
from tests.support.live import AsyncClient, Member, clients, live_server

ABSURD = [float("nan"), float("inf"), -float("inf"), -1.0, 1e308, True, "1", None]


def _finish_times(fits: dict[int, Fit], sizes: dict[int, int]) -> list[float]:
    return [fits[w].predict(n) for w, n in sizes.items()]


# --- the model -------------------------------------------------------------------------------


def test_model_recovers_alpha_and_beta_from_two_calibration_sizes() -> None:
    model = PerfModel()
    # t = 0.004 + 0.0005 b at b = 8 and 32, three steps each
    assert model.seed([8, 8, 8, 32, 32, 32], [0.008, 0.008, 0.008, 0.02, 0.02, 0.02]) == 6
    fit = model.fit()
    assert fit is not None and not fit.proportional
    assert fit.alpha_s == pytest.approx(0.004)
    assert fit.beta_s_per_sample == pytest.approx(0.0005)
    assert fit.transfer_s == 0.0
    model.add_transfer(0.003)
    model.add_transfer(0.005)
    fit = model.fit()
    assert fit is not None and fit.transfer_s == pytest.approx(0.004)
    assert fit.predict(16) == pytest.approx(0.004 + 0.008 + 0.004)


def test_outliers_are_down_weighted() -> None:
    rng = random.Random(0)
    model = PerfModel()
    for _ in range(30):
        b = rng.choice([10, 20, 40])
        model.add_compute(b, 0.002 + 0.001 * b + rng.uniform(-1e-5, 1e-5))
    model.add_compute(20, 5.0)  # a stalled step
    model.add_compute(40, 3.0)
    fit = model.fit()
    assert fit is not None
    assert fit.alpha_s == pytest.approx(0.002, abs=3e-4)
    assert fit.beta_s_per_sample == pytest.approx(0.001, rel=0.02)
    for _ in range(10):
        model.add_transfer(0.01)
    model.add_transfer(100.0)
    fit = model.fit()
    assert fit is not None and fit.transfer_s == pytest.approx(0.01, rel=1e-3)


def test_window_follows_a_change_of_speed() -> None:
    model = PerfModel(window=8)
    for b in (10, 20) * 4:
        model.add_compute(b, 0.001 * b)
    for b in (10, 20) * 4:
        model.add_compute(b, 0.004 * b)  # the worker became 4x slower
    fit = model.fit()
    assert fit is not None and fit.beta_s_per_sample == pytest.approx(0.004)


def test_one_batch_size_falls_back_to_proportional() -> None:
    model = PerfModel()
    for _ in range(5):
        model.add_compute(16, 0.032)
    fit = model.fit()
    assert fit is not None and fit.proportional
    assert fit.alpha_s == 0.0 and fit.beta_s_per_sample == pytest.approx(0.002)
    assert robust_line([(16, 0.032), (16, 0.03)]) is None


def test_negative_intercept_is_refitted_through_the_origin() -> None:
    alpha, beta = robust_line([(10, 0.005), (20, 0.02), (30, 0.035)]) or (None, None)
    assert alpha == 0.0
    assert beta == pytest.approx((10 * 0.005 + 20 * 0.02 + 30 * 0.035) / (100 + 400 + 900))


def test_absurd_measurements_are_ignored() -> None:
    model = PerfModel()
    assert model.fit() is None
    for value in ABSURD:
        assert not model.add_compute(8, value)
        assert not model.add_compute(value, 0.01)
        assert not model.add_transfer(value)
    assert not model.add_compute(8, 0.0)  # no compute takes no time
    assert not model.add_compute(8.5, 0.01)
    assert model.seed([8, float("nan"), 0, 16], [0.01, 0.01, 0.01, -2]) == 1
    assert model.fit() == Fit(0.0, 0.01 / 8, 0.0, proportional=True)
    assert model.seed([1] * 40, [0.01] * 40) == 16  # at most MAX_CALIBRATION pairs kept


# --- the planner -----------------------------------------------------------------------------


def test_equal_models_split_equally() -> None:
    fits = {1: Fit(0.01, 0.001, 0.0), 2: Fit(0.01, 0.001, 0.0)}
    assert plan_by_model(fits, 64) == {1: 32, 2: 32}


def test_without_fixed_costs_the_plan_is_the_speed_ratio() -> None:
    fits = {1: Fit(0.0, 0.001, 0.0), 2: Fit(0.0, 0.002, 0.0)}
    # continuous 42.67 / 21.33; the spare sample goes where it finishes first (43 ms < 44 ms)
    assert plan_by_model(fits, 64) == {1: 43, 2: 21}
    assert plan_batches({1: 1000.0, 2: 500.0}, 64) == {1: 43, 2: 21}


def test_a_large_transfer_term_gets_fewer_samples() -> None:
    # Same compute; worker 2 spends 20 ms per round on the wire. T = (64 + 2 + 22) / 2000 s.
    fits = {1: Fit(0.002, 0.001, 0.0), 2: Fit(0.002, 0.001, 0.02)}
    sizes = plan_by_model(fits, 64)
    assert sizes == {1: 42, 2: 22}
    assert _finish_times(fits, sizes) == pytest.approx([0.044, 0.044])


def test_three_workers_with_fixed_costs_finish_together() -> None:
    # slowdowns 1, 2, 4 of alpha = 2 ms, beta = 0.125 ms; 3 ms transfer each.
    fits = {w: Fit(0.002 * f, 0.000125 * f, 0.003) for w, f in ((1, 1), (2, 2), (3, 4))}
    sizes = plan_by_model(fits, 64)
    assert sizes is not None and sum(sizes.values()) == 64
    # T = (64 + 40 + 28 + 22) / (8000 + 4000 + 2000) = 0.011 s: b = 48, 16, 0 (one sample
    # would take 11.5 ms on worker 3 > 11 ms), so worker 3 sits out; without it
    # T = (64 + 40 + 28) / 12000 = 11 ms and b = 48 and 16.
    assert sizes == {1: 48, 2: 16}
    times = _finish_times(fits, sizes)
    assert max(times) - min(times) < 1e-9
    # The speed ratio would give 37/18/9 and make worker 3 finish at 15.5 ms, not 11.
    assert plan_batches({1: 4.0, 2: 2.0, 3: 1.0}, 64) == {1: 37, 2: 18, 3: 9}


def test_a_worker_that_cannot_contribute_gets_zero_and_a_probe() -> None:
    fits = {1: Fit(0.0, 0.001, 0.0), 2: Fit(0.1, 0.001, 0.0)}
    # with both: T = (64 + 100) / 2000 = 82 ms < 100 ms fixed cost of worker 2;
    # without it T = 64 ms < 101 ms for one sample on worker 2: it gets 0.
    assert plan_by_model(fits, 64) == {1: 64}
    assert plan_by_model(fits, 64, probe=[2]) == {1: 63, 2: 1}
    assert plan_by_model(fits, 64, probe=[7]) == {1: 64}  # not a member: ignored


def test_a_marginal_worker_keeps_one_sample() -> None:
    # Worker 2's continuous share is 0.75 (T = (64 + 62.5) / 2000 = 63.25 ms), but one sample
    # (63.5 ms) ends before the 64 ms worker 1 needs alone: it keeps one, the round 63.5 ms.
    fits = {1: Fit(0.0, 0.001, 0.0), 2: Fit(0.0625, 0.001, 0.0)}
    assert plan_by_model(fits, 64) == {1: 63, 2: 1}
    # At 63.5 ms of fixed cost one sample (64.5 ms) would end after 64 ms: it gets 0.
    fits = {1: Fit(0.0, 0.001, 0.0), 2: Fit(0.0635, 0.001, 0.0)}
    assert plan_by_model(fits, 64) == {1: 64}


def test_sum_is_kept_for_many_random_models() -> None:
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 9)
        fits = {
            w: Fit(rng.uniform(0, 0.05), 10 ** rng.uniform(-7, -1), rng.uniform(0, 0.05))
            for w in range(n)
        }
        total = rng.randint(0, 3000)
        sizes = plan_by_model(fits, total)
        assert sizes is not None and sum(sizes.values()) == total
        assert all(n >= 1 for n in sizes.values())
        # greedy rounding: moving one sample between planned workers never shortens the round
        for src in (w for w, b in sizes.items() if b > 1):
            for dst in (w for w in sizes if w != src):
                moved = {**sizes, src: sizes[src] - 1, dst: sizes[dst] + 1}
                assert max(_finish_times(fits, moved)) >= max(_finish_times(fits, sizes)) - 1e-12


def test_absurd_and_zero_inputs() -> None:
    good = Fit(0.001, 0.001, 0.0)
    for bad in (
        Fit(math.nan, 0.001, 0.0),
        Fit(0.001, math.inf, 0.0),
        Fit(0.001, 0.0, 0.0),
        Fit(-1.0, 0.001, 0.0),
        Fit(0.001, 0.001, -0.5),
        Fit(1e308, 0.001, 0.0),
    ):
        assert plan_by_model({1: good, 2: bad}, 64) is None  # the caller plans by speed
    assert plan_by_model({}, 64) == {}
    assert plan_by_model({1: good}, 0) == {}
    assert plan_by_model({1: good, 2: good}, -5) == {}
    assert plan_by_model({1: good}, 64) == {1: 64}
    # fewer samples than workers: one each to the quickest
    fits = {1: Fit(0.0, 0.003, 0.0), 2: Fit(0.0, 0.001, 0.0), 3: Fit(0.0, 0.002, 0.0)}
    assert plan_by_model(fits, 2) == {2: 1, 3: 1}
    # extreme but finite models still sum to B
    fits = {1: Fit(0.0, 1e-9, 0.0), 2: Fit(99_000.0, 99_000.0, 0.0)}
    assert plan_by_model(fits, 100_000) == {1: 100_000}


def test_expected_max_of_standard_normals() -> None:
    assert expected_max_deviate(1) == 0.0
    assert expected_max_deviate(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert expected_max_deviate(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-4)
    assert expected_max_deviate(4) == pytest.approx(1.0294, abs=1e-4)


def test_a_spread_drops_a_member_that_adds_more_wait_than_it_saves() -> None:
    # Two workers at 1 ms per sample, one at 4 ms: T = 64 / 2.25 = 28.4 ms continuous; the
    # integers give 29 / 28 / 7 samples (29, 28 and 28 ms). Without worker 3 it is 32 / 32.
    fits = {1: Fit(0.0, 0.001, 0.0), 2: Fit(0.0, 0.001, 0.0), 3: Fit(0.0, 0.004, 0.0)}
    three, two = {1: 29, 2: 28, 3: 7}, {1: 32, 2: 32}
    assert plan_by_model(fits, 64) == three
    # Expected: 29 ms + 0.8463 s vs 32 ms + 0.5642 s: worker 3 costs more above s = 10.6 ms.
    assert plan_by_model(fits, 64, spread_s=0.010) == three
    latest = max(fits[w].predict(n) for w, n in three.items())
    expected = latest + 0.010 * expected_max_deviate(len(three))
    assert expected == pytest.approx(0.029 + 0.010 * 0.8463, abs=1e-5)
    assert plan_by_model(fits, 64, spread_s=0.011) == two
    # One worker alone (64 ms) only beats 32 ms + 0.5642 s beyond s = 56.7 ms.
    assert plan_by_model(fits, 64, spread_s=0.056) == two
    assert plan_by_model(fits, 64, spread_s=0.058) == {1: 64}
    # A dropped worker is still probed; absurd spreads plan on predictions alone.
    assert plan_by_model(fits, 64, probe=[3], spread_s=0.011) == {1: 32, 2: 31, 3: 1}
    for absurd in (math.nan, math.inf, -0.01, 1e308):
        assert plan_by_model(fits, 64, spread_s=absurd) == three


def test_round_spread_measures_scatter_between_members() -> None:
    spread = RoundSpread(horizon=20, min_rounds=4)
    for i in range(3):  # members 1 ms either side of the round's mean, alternating
        spread.add_round([0.011, 0.009][:: 1 - 2 * (i % 2)], [0.010, 0.010])
    assert spread.sigma_s() == 0.0  # fewer than min_rounds measured rounds
    spread.add_round([0.016, 0.014], [0.010, 0.010])  # both 5 ms late: the shared part cancels
    expected = 1.4826 * math.sqrt(2) * 0.001  # deviations +-sqrt(2) ms (n = 2)
    assert spread.sigma_s() == pytest.approx(expected, rel=1e-9)
    for bad in ABSURD:
        spread.add_round([bad, 0.011], [0.010, bad])  # type: ignore[list-item]
        spread.add_round([0.011], [0.010])  # one member: no deviation
    assert spread.sigma_s() == pytest.approx(expected, rel=1e-9)
    for _ in range(20):  # the horizon passes without a round of two members
        spread.add_round([0.011], [0.010])
    assert spread.sigma_s() == 0.0 and not spread.recent


# --- the protocol fields that seed the model -------------------------------------------------


def test_task_request_calibration_fields_are_optional_and_validated() -> None:
    plain = TaskRequest(worker_id=1, token="t", speed=10.0)
    frames = plain.to_wire(5)
    assert b"calibration" not in b"".join(bytes(f) for f in frames)  # old servers accept it
    assert parse_message(frames, WORKER_REQUESTS)[0] == plain
    seeded = TaskRequest(
        worker_id=1, token="t", speed=10.0, calibration_batches=[8, 32], calibration_s=[0.01, 0.03]
    )
    assert parse_message(seeded.to_wire(6), WORKER_REQUESTS)[0] == seeded
    body = {"worker_id": 1, "token": "t", "speed": 10.0, "calibration_s": [float("nan")]}
    header = {"v": PROTOCOL_VERSION, "type": "task_request", "id": 7, "status": "ok", "body": body}
    with pytest.raises(ProtocolError, match="finite"):
        parse_message(encode_frames(header), WORKER_REQUESTS)
    body = {**body, "calibration_s": "fast"}
    header = {**header, "body": body}
    with pytest.raises(ProtocolError, match="calibration_s"):
        parse_message(encode_frames(header), WORKER_REQUESTS)


# --- a live server plans on the calibration its workers send --------------------------------


async def _join_calibrated(
    client: AsyncClient, name: str, batches: list[int], seconds: list[float]
) -> tuple[Member, TaskReply]:
    join = await client.request(JoinRequest(name=name, device="cpu", slowdown=1.0, threads=1))
    assert isinstance(join, JoinReply)
    task = await client.request(
        TaskRequest(
            worker_id=join.worker_id,
            token=join.token,
            speed=100.0,  # equal speeds: the speed planner would split 15 / 15
            calibration_batches=batches,
            calibration_s=seconds,
        )
    )
    assert isinstance(task, TaskReply) and task.action == "train"
    return Member(join), task


async def test_live_server_plans_on_calibration_and_measures_the_barrier(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=2, global_batch=30) as ps,
        clients(ps.address, 3) as (a, b, hostile),
    ):
        join = await hostile.request(JoinRequest(name="h", device="cpu", slowdown=1, threads=1))
        assert isinstance(join, JoinReply)
        for batches, seconds in (([8, 32], [0.01]), ([8] * 17, [0.01] * 17)):
            bad = TaskRequest(
                worker_id=join.worker_id,
                token=join.token,
                speed=1.0,
                calibration_batches=batches,
                calibration_s=seconds,
            )
            assert (await hostile.expect_error(bad)).code == ErrorCode.BAD_FIELD
        await hostile.request(LeaveRequest(worker_id=join.worker_id, token=join.token, reason=""))
        # a: t = 1 ms * b; b: t = 10 ms + 1 ms * b. T = (30 + 10) / 2000 s: 20 and 10 samples.
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(
            _join_calibrated(a, "a", [8, 32, 8], [0.008, 0.032, 0.008]),
            _join_calibrated(b, "b", [8, 32, 10**9], [0.018, 0.042, 1e308]),
        )
        assert [len(task_a.indices), len(task_b.indices)] == [20, 10]
        summary = {w["name"]: w for w in ps.roster.summaries()}
        assert summary["b"]["model"] == {  # the absurd third pair was ignored
            "alpha_s": pytest.approx(0.01),
            "beta_s_per_sample": pytest.approx(0.001),
            "transfer_s": 0.0,
        }
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        await asyncio.gather(a.push(member_a, task_a, zeros), b.push(member_b, task_b, zeros))
        policy = ps.policy
        assert isinstance(policy, WeightedSync) and policy.last_timing is not None
        timing = policy.last_timing
        assert set(timing.workers) == {member_a.worker_id, member_b.worker_id}
        for part in timing.workers.values():
            assert part.predicted_s == pytest.approx(0.02)
            assert part.actual_s + part.idle_s + timing.step_s == pytest.approx(timing.round_s)
        assert min(p.idle_s for p in timing.workers.values()) == 0.0  # the last push waits not
        share = policy.idle_share()
        assert share is not None and 0 <= share < 1
        assert all(float(w["idle_s"]) >= 0 for w in ps.roster.summaries())  # type: ignore[arg-type]


# --- the weighted-sync policy with each planner ----------------------------------------------


def _policy(planner: str, plan_spread: bool = True) -> tuple[WeightedSync, list[WorkerInfo]]:
    config = ServerConfig(
        dataset=Path("unused.h5"),
        model="hsi-cnn",
        planner=planner,
        plan_spread=plan_spread,
        global_batch=64,
        epochs=50,
    )
    policy = WeightedSync(
        config, EpochSampler(640, 0, max_epochs=50), tasks=TaskFactory(np.arange(640))
    )
    workers = []
    for wid, transfer in ((1, 0.0), (2, 0.02)):  # same compute; worker 2 on a slow link
        worker = WorkerInfo(wid, f"w{wid}", "cpu", 1.0, 1, speed=100.0 * wid)
        worker.perf.seed([8, 32], [0.002 + 0.008, 0.002 + 0.032])
        worker.perf.add_transfer(transfer)
        workers.append(worker)
    return policy, workers


@pytest.mark.parametrize(
    ("planner", "sizes"),
    [("model", {1: 42, 2: 22}), ("compute", {1: 32, 2: 32}), ("speed", {1: 21, 2: 43})],
)
def test_weighted_sync_plans_with_the_chosen_planner(planner: str, sizes: dict) -> None:
    policy, workers = _policy(planner)
    assert policy.batch_sizes(workers, 64) == sizes


def test_weighted_sync_falls_back_to_speed_and_reprobes_a_worker_at_zero() -> None:
    policy, (fast, slow) = _policy("model")
    fresh = WorkerInfo(3, "w3", "cpu", 1.0, 1, speed=200.0)  # no calibration, no push
    assert policy.batch_sizes([fast, fresh], 60) == plan_batches({1: 100.0, 3: 200.0}, 60)
    slow.perf.add_transfer(0.5)
    slow.perf.add_transfer(0.5)  # now 0.5 s per round on the wire: it cannot contribute
    slow.perf.fit()  # as the server refits a pusher's model after its round (settle)
    plans = [policy.batch_sizes([fast, slow], 64) for _ in range(1000)]
    assert plans[0] == {1: 64}
    probes = [i for i, plan in enumerate(plans) if plan.get(2)]
    assert plans[PROBE_EVERY] == {1: 63, 2: 1}
    # each probe that leaves it at 0 doubles the wait for the next one, up to PROBE_EVERY_MAX
    waits = [b - a - 1 for a, b in itertools.pairwise([-1, *probes])]
    assert waits == [20, 40, 80, 160, 320, 320] and PROBE_EVERY_MAX == 320
    slow.perf.transfer.clear()  # its link recovers (as a probe would measure): it is back
    slow.perf.add_transfer(0.0)
    slow.perf.fit()
    plans = [policy.batch_sizes([fast, slow], 64) for _ in range(PROBE_EVERY_MAX + 1)]
    back = next(i for i, plan in enumerate(plans) if plan.get(2))
    assert all(plan.get(2, 0) > 1 for plan in plans[back:])
    assert (
        slow.worker_id not in policy.planner.probes.probe_after
    )  # a later loss starts again at 20 rounds


def test_weighted_sync_probes_a_recovering_worker_again_at_once() -> None:
    """A worker left at 0 since it became 50x slower gets its probe after PROBE_EVERY plans;
    the probe runs as fast as before, so the next plan probes it again, and the third such
    probe is a change point of its model that plans it back in."""
    policy, (fast, slow) = _policy("model")
    for factor in [1] * 10 + [50] * 3:  # its share, then 50x slower: a change point
        slow.perf.add_compute(22, factor * (0.002 + 0.022))
        slow.perf.fit()
    plans = []
    for _ in range(PROBE_EVERY + 4):
        plans.append(policy.batch_sizes([fast, slow], 64))
        if plans[-1].get(2):  # as the server refits a pusher's model after its round
            slow.perf.add_compute(plans[-1][2], 0.002 + 0.001 * plans[-1][2])
            slow.perf.fit()
    assert plans[0] == {1: 64}
    assert [i for i, plan in enumerate(plans) if plan.get(2) == 1] == [20, 21, 22]
    assert plans[PROBE_EVERY + 3] == {1: 42, 2: 22}  # its model is back: the plan as before
    assert slow.perf.compute_shift.found == 2  # its slowdown, then its recovery


@pytest.mark.parametrize("plan_spread", [True, False])
def test_weighted_sync_weighs_the_measured_spread_when_asked(plan_spread: bool) -> None:
    policy, workers = _policy("model", plan_spread)
    for _ in range(8):  # members 30 ms either side of the round's mean, round after round
        policy.planner.spread.add_round([0.074, 0.014], [0.044, 0.044])
    # spread 1.4826 * sqrt(2) * 30 ms = 63 ms: 42 / 22 samples are expected to end at
    # 44 ms + 0.5642 * 63 ms = 79 ms, worker 1 alone at 2 + 64 = 66 ms.
    assert policy.batch_sizes(workers, 64) == ({1: 64} if plan_spread else {1: 42, 2: 22})
    assert ("round_spread_s" in policy.summary()) == plan_spread


def test_weighted_sync_measures_the_spread_on_members_of_consecutive_rounds() -> None:
    policy, workers = _policy("model")
    roster = Roster(60.0, lambda worker: None, tokens=TokenBook(new_key()), max_members=8)
    for round_id in (1, 2, 3):
        for worker, task in policy.plan(workers):  # this round's tasks and the next one's
            worker.tasks.append(task)
        update = None
        for worker in workers:  # the server's order: accept each push, then book the step
            task = policy.runnable(worker)
            assert task is not None
            push = PushRequest(
                worker.worker_id, "tok", task.task_id, 0, task.size, 1.0, 0.01, 0.0, 1.0
            )
            update = policy.accept(worker, task, push) or update
        assert update is not None
        policy.applied(update)
        for worker, task, _ in update.entries:
            worker.tasks.remove(task)
            part = policy.last_timing.workers.get(worker.worker_id)
            roster.account_round(worker, part, round_id)
        # round 1 is every member's first (no prefetch): only rounds 2 and 3 are measured
        assert [r for r, _ in policy.planner.spread.recent] == list(range(2, round_id + 1))
        assert all(len(devs) == 2 for _, devs in policy.planner.spread.recent)


def test_weighted_sync_refits_a_pushers_model_while_its_round_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiting pusher's model is refitted while its round waits, once ``REFIT_EVERY``
    pushes came in since its last fit; the closing pusher's only after the plan, which takes
    its last fit; a model with fewer new pushes keeps its fit."""
    policy, workers = _policy("model")
    for worker, task in policy.plan(workers):
        worker.tasks.append(task)
    for worker in workers:  # one push short of a refit
        for _ in range(REFIT_EVERY - 1):
            worker.perf.add_compute(32, 0.002 + 0.032)
    refits: list[str] = []
    refit = PerfModel._refit

    def counted(model: PerfModel) -> Fit | None:
        refits.append(next(w.name for w in workers if w.perf is model))
        return refit(model)

    monkeypatch.setattr(PerfModel, "_refit", counted)
    decisions = []
    for worker in workers:
        task = policy.runnable(worker)
        assert task is not None
        worker.perf.add_compute(task.size, 0.002 + task.size * 1e-3)
        push = PushRequest(worker.worker_id, "tok", task.task_id, 0, task.size, 1.0, 0.01, 0.0, 1.0)
        decisions.append(policy.decide(worker, task, push, 0, 1.0))
        if worker is workers[0]:
            assert decisions[0].update is None and refits == ["w1"]  # refitted while it waits
    update = decisions[1].update
    assert update is not None and refits == ["w1"]  # the closing push: not yet
    policy.batch_sizes(workers, 64)
    assert refits == ["w1"]  # the plan takes the closing pusher's last fit as it is
    policy.settle(update)
    assert refits == ["w1", "w2"]  # refitted once the replies are out (w1's is current)
    for worker in workers:
        worker.perf.add_compute(32, 0.002 + 0.032)
    policy.settle(update)
    assert refits == ["w1", "w2"]  # one push since their fits: the fits stand
