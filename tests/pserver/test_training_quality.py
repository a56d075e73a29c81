"""Training quality with speed-sized local batches: epoch tails weighted by b / B, BatchNorm
statistics merged by share of the global batch, the minimum local batch, GroupNorm builds that
make weighted-sync exact, and the curve-stability figure of comparisons."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import ModelError
from common.protocol.messages import PushRequest
from common.training.flat import FlatLayout
from common.training.models import build_model, has_batchnorm, with_norm
from common.training.perfmodel import Fit
from common.training.planner import plan_by_model, plan_by_speed, tail_scale
from common.training.probes import PROBE_EVERY
from common.training.slowdown import SlowdownSchedule
from launch.compare import drop_stats, max_drop
from launch.ddp.step import ComputeOnlyStep
from launch.report import RESULT_COLUMNS, render_markdown
from pserver.config import ServerConfig
from pserver.membership import TaskFactory, WorkerInfo
from pserver.policies.base import Update
from pserver.policies.equal_sync import EqualSync
from pserver.policies.sync_rounds import Round
from pserver.policies.weighted_sync import (
    BATCHNORM_MIN_LOCAL_BATCH,
    WeightedSync,
    resolve_min_local_batch,
)
from pserver.sampler import EpochSampler
from pserver.store.optimizer import FlatOptimizer
from pserver.store.slices import SliceStore
from tests.support.pushes import push_of


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Small tensors: one thread is fastest, and on a busy machine much faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- epoch tails -----------------------------------------------------------------------------


def _push(task_id: int) -> PushRequest:
    return PushRequest(1, "t", task_id, 0, 1, 1.0, 0.01, 0.0, 0.5)


def _drive(
    policy_cls: type, n: int, batch: int, epochs: int, leave_in: int = 0
) -> tuple[list[Update], list[int]]:
    """Plan and close every round of ``epochs`` epochs over ``n`` samples with three workers;
    returns the updates and the epochs whose ledger proved every sample used exactly once.
    With ``leave_in`` r, worker 2 leaves once it pushed in round r - 1, before pushing its
    tasks of rounds r and r + 1 (planned ahead)."""
    config = ServerConfig(
        dataset=Path("unused.h5"),
        model="hsi-cnn",
        mode=policy_cls.name,
        global_batch=batch,
        epochs=epochs,
    )
    sampler = EpochSampler(n, 0, max_epochs=epochs)
    policy = policy_cls(config, sampler, tasks=TaskFactory(np.arange(n)))
    workers = [
        WorkerInfo(w, f"w{w}", "cpu", 1.0, 1, speed=s) for w, s in ((1, 40.0), (2, 20.0), (3, 4.0))
    ]
    updates, exact = [], []
    while True:
        policy.plan(workers)
        if not policy.rounds:
            break
        current = policy.rounds[0]
        if current.round_id == leave_in:
            gone = workers.pop(1)
            dropped = [t for rnd in policy.rounds for w, t in rnd.tasks.values() if w is gone]
            assert dropped and policy.leave(gone, dropped) == []  # no sample goes back
            assert all(rnd.orphans for rnd in policy.rounds)  # both rounds wait for them
            made = policy.plan(workers)
            assert {t.round_id for _, t in made} == {leave_in, leave_in + 1}
        update = None
        for worker, task in list(current.tasks.values()):
            update = policy.accept(worker, task, _push(task.task_id))
        assert update is not None
        policy.applied(update)
        updates.append(update)
        for _, task, _ in update.entries:
            ledger = sampler.record_applied(task.epoch, task.positions)
            if ledger.complete:
                if (ledger.uses == 1).all():
                    exact.append(ledger.epoch)
                sampler.forget(ledger.epoch)
    return updates, exact


@pytest.mark.parametrize("policy_cls", [WeightedSync, EqualSync])
@pytest.mark.parametrize("tail", [1, 3, 5])
def test_an_epoch_tail_is_weighted_by_its_share_and_every_sample_is_used_once(
    policy_cls: type, tail: int
) -> None:
    batch = 32
    n = 4 * batch + tail
    updates, exact = _drive(policy_cls, n, batch, epochs=3)
    assert exact == [1, 2, 3]  # the epoch check still proves exactly-once
    assert len(updates) == 3 * 5
    for update in updates:
        weight = math.fsum(update.weights)
        assert update.buffer_scale == 1.0  # statistics changes carry the same weights
        if update.samples == batch:
            assert weight == pytest.approx(1.0)
        else:  # never a full-weight step of a handful of samples
            assert update.samples == tail
            assert weight == pytest.approx(tail / batch)
    assert tail_scale(batch + 7, batch) == 1.0


def _sample_weights(update: Update) -> dict[int, float]:
    """Each sample's weight in an update: its task's weight over the task's samples (what
    multiplies the sample's gradient in the step)."""
    return {int(p): w / task.size for _, task, w in update.entries for p in task.positions.tolist()}


@pytest.mark.parametrize("policy_cls", [WeightedSync, EqualSync])
def test_a_worker_that_leaves_mid_round_changes_no_update(policy_cls: type) -> None:
    batch, n = 32, 4 * 32 + 5
    steady, _ = _drive(policy_cls, n, batch, epochs=2)
    faulted, exact = _drive(policy_cls, n, batch, epochs=2, leave_in=3)
    assert exact == [1, 2] and len(faulted) == len(steady) == 10
    # equal-sync weighs each worker alike: rounds planned after the leave, over two workers,
    # weigh samples otherwise; the two rounds worker 2 was planned in are the same
    pairs = list(zip(steady, faulted, strict=True))
    for before, after in pairs if policy_cls is WeightedSync else pairs[2:4]:
        weights, planned = _sample_weights(after), _sample_weights(before)
        assert weights.keys() == planned.keys()  # the same samples, each weighted alike
        assert weights == pytest.approx(planned)
        assert math.fsum(after.weights) == pytest.approx(after.samples / batch)
    changed = faulted[2]  # the round worker 2 left: worker 1 or 3 took its samples
    assert {w.worker_id for w, _, _ in changed.entries} <= {1, 3} and len(changed.entries) > 2


def test_a_round_nobody_is_left_in_waits_for_a_worker() -> None:
    config = ServerConfig(dataset=Path("unused.h5"), model="hsi-cnn", global_batch=8, epochs=1)
    policy = WeightedSync(
        config, EpochSampler(16, 0, max_epochs=1), tasks=TaskFactory(np.arange(16))
    )
    alone = WorkerInfo(1, "a", "cpu", 1.0, 1, speed=10.0)
    planned = policy.plan([alone])
    assert policy.leave(alone, [t for _, t in planned]) == []
    assert policy.plan([]) == [] and policy.runnable(alone) is None
    late = WorkerInfo(2, "late", "cpu", 1.0, 1, speed=10.0)
    adopted = policy.plan([late])
    assert [t.positions.tolist() for _, t in adopted] == [t.positions.tolist() for _, t in planned]
    late.tasks.append(adopted[0][1])  # what the server's desk queues
    assert policy.runnable(late) is adopted[0][1]


def test_ddp_weighs_its_epoch_tail_step_as_the_parameter_server_does() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    reference = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    reference.load_state_dict(model.state_dict())
    step = ComputeOnlyStep(
        model,
        model,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        schedule=SlowdownSchedule(1.0),
        all_reduce=lambda t: None,
    )
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    before = reference[1].running_mean.clone()
    step.run(0, x, y, scale=tail_scale(3, 64))  # an epoch's tail of 3 samples, B = 64
    nn.functional.cross_entropy(reference(x), y).backward()
    for mine, full in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, full.grad * 3 / 64)
    moved = reference[1].running_mean - before
    torch.testing.assert_close(model[1].running_mean, before + moved * 3 / 64)


# --- BatchNorm statistics ----------------------------------------------------------------------


def _whole_store(layout: FlatLayout, optimizer: FlatOptimizer) -> SliceStore:
    """One store holding every parameter of ``layout``, at its current state."""
    return SliceStore(
        0,
        layout.size,
        num_params=layout.num_params,
        state=layout.read_state(),
        optimizer=optimizer,
        nonneg_bounds=[],
        chunk_elems=1 << 20,
    )


def _local_push(
    model: nn.Module, layout: FlatLayout, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """What a worker pushes for one local batch: mean gradient and statistics change, with the
    model's state left as it was."""
    state = layout.read_state()
    model.train()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    push = push_of(layout, state)
    layout.write_state(state)
    return push


@pytest.mark.parametrize(("sizes", "batch"), [({1: 60, 2: 4}, 64), ({1: 3, 2: 2}, 64)])
def test_batchnorm_statistics_after_a_round_with_a_tiny_share_equal_the_hand_merge(
    sizes: dict[int, int], batch: int
) -> None:
    torch.manual_seed(0)
    model = build_model("hsi-cnn", in_channels=6, num_classes=3, input_size=5)
    bn = model[1]
    with torch.no_grad():  # statistics away from their initial 0 / 1
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    mean0, var0 = bn.running_mean.clone(), bn.running_var.clone()
    layout = FlatLayout(model)
    total = sum(sizes.values())
    x, y = torch.randn(total, 6, 5, 5) * 2 + 1, torch.randint(0, 3, (total,))
    bounds = np.cumsum([0, *sizes.values()])
    parts = {w: (x[a:b], y[a:b]) for w, a, b in zip(sizes, bounds[:-1], bounds[1:], strict=True)}
    # by hand: each worker's BatchNorm moves the statistics by m (its batch statistic - old),
    # and the server adds those moves weighted by b_i / B (B the global batch, also for a tail)
    expected_mean, expected_var = mean0.clone(), var0.clone()
    for w, n in sizes.items():
        with torch.no_grad():
            h = model[0](parts[w][0])  # the first BatchNorm's input
        share = n / batch
        expected_mean += share * bn.momentum * (h.mean(dim=(0, 2, 3)) - mean0)
        expected_var += share * bn.momentum * (h.var(dim=(0, 2, 3), unbiased=True) - var0)
    pushes = {w: _local_push(model, layout, *parts[w]) for w in sizes}
    # the round as the policy closes it, applied by the store as the server applies it
    workers = {w: WorkerInfo(w, f"w{w}", "cpu", 1.0, 1) for w in sizes}
    tasks = TaskFactory(np.arange(total))
    planned = {w: tasks.new(1, np.arange(n), 1) for w, n in sizes.items()}
    weights = WeightedSync.weights(None, sizes)  # type: ignore[arg-type]
    by_task = {t.task_id: (workers[w], t) for w, t in planned.items()}
    rnd = Round(1, 1, by_task, {planned[w].task_id: weights[w] for w in sizes})
    rnd.scale = tail_scale(total, batch)
    rnd.received = dict(by_task)
    update = rnd.update()
    optimizer = FlatOptimizer("sgd", lr=0.05)
    store = _whole_store(layout, optimizer)
    for w, push in pushes.items():
        store.stage(planned[w].task_id, w, 0, 0, 1.0, push)
    ok, reason = store.prepare(1, update.task_ids, update.weights, 1.0, update.buffer_scale)
    assert ok, reason
    store.publish(1)
    layout.write_state(store.state)
    torch.testing.assert_close(bn.running_mean, expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, expected_var, rtol=1e-5, atol=1e-6)
    tiny = min(sizes, key=lambda w: sizes[w])  # the tiny share moved them by b / B of its move
    assert update.weights[sorted(sizes).index(tiny)] == pytest.approx(sizes[tiny] / batch)


# --- the minimum local batch -------------------------------------------------------------------


def test_a_share_below_the_minimum_sits_out_and_a_probe_gives_the_minimum() -> None:
    fits = {
        1: Fit(0.002, 0.001, 0.0),
        2: Fit(0.002, 0.001, 0.0),
        3: Fit(0.002, 0.008, 0.0),  # 8x slower per sample: 3.76 of 64 samples
    }
    assert plan_by_model(fits, 64) == {1: 31, 2: 30, 3: 3}
    planned = plan_by_model(fits, 64, min_batch=8)
    assert planned == {1: 32, 2: 32}  # its 6 samples went to the others
    probed = plan_by_model(fits, 64, probe=[3], min_batch=8)
    assert probed is not None and probed[3] == 8 and sum(probed.values()) == 64
    assert min(probed.values()) >= 8
    # by speed: 40 / 20 / 4 samples per second
    speeds = {1: 40.0, 2: 20.0, 3: 4.0}
    assert plan_by_speed(speeds, 64) == {1: 40, 2: 20, 3: 4}
    assert plan_by_speed(speeds, 64, min_batch=8) == {1: 43, 2: 21}
    assert plan_by_speed(speeds, 64, probe=[3], min_batch=8) == {1: 35, 2: 21, 3: 8}
    # a tail smaller than the minimum goes to one worker (weighted b / B by the round)
    assert plan_by_speed(speeds, 5, min_batch=8) == {1: 5}


def test_weighted_sync_leaves_out_a_worker_below_the_minimum_and_probes_it() -> None:
    config = ServerConfig(
        dataset=Path("unused.h5"), model="hsi-cnn", global_batch=64, epochs=5, min_local_batch=8
    )
    policy = WeightedSync(
        config, EpochSampler(640, 0, max_epochs=5), tasks=TaskFactory(np.arange(640))
    )
    workers = []
    for wid, per_sample in ((1, 0.001), (2, 0.001), (3, 0.008)):
        worker = WorkerInfo(wid, f"w{wid}", "cpu", 1.0, 1, speed=1 / per_sample)
        worker.perf.seed([8, 32], [0.002 + 8 * per_sample, 0.002 + 32 * per_sample])
        workers.append(worker)
    plans = [policy.batch_sizes(workers, 64) for _ in range(PROBE_EVERY + 1)]
    assert all(3 not in plan for plan in plans[:PROBE_EVERY])  # reported as planned at 0
    assert plans[PROBE_EVERY][3] == 8  # then probed with the minimum, never fewer samples
    assert policy.planner.min_batch == 8


def test_the_minimum_defaults_on_for_batchnorm_models_in_weighted_sync() -> None:
    def config(**kw: object) -> ServerConfig:
        return ServerConfig(dataset=Path("unused.h5"), model="hsi-cnn", epochs=1, **kw)  # type: ignore[arg-type]

    assert resolve_min_local_batch(config(), True).min_local_batch == BATCHNORM_MIN_LOCAL_BATCH
    assert resolve_min_local_batch(config(), False).min_local_batch == 1
    assert resolve_min_local_batch(config(mode="equal-sync"), True).min_local_batch == 1
    small = config(global_batch=12, workers=3)  # at most B / workers
    assert resolve_min_local_batch(small, True).min_local_batch == 4
    assert resolve_min_local_batch(config(min_local_batch=3), True).min_local_batch == 3


# --- GroupNorm builds --------------------------------------------------------------------------


def test_group_norm_builds_have_no_batch_statistics() -> None:
    assert with_norm("hsi-cnn", "group") == "hsi-cnn-gn"
    assert with_norm("hsi-cnn", "batch") == "hsi-cnn"
    with pytest.raises(ModelError, match="no GroupNorm build"):
        with_norm("pkg.mod:factory", "group")
    for name in ("hsi-cnn", "scene-cnn", "resnet18", "hsi-3dcnn"):
        model = build_model(with_norm(name, "group"), 5, 3, 9)
        assert not has_batchnorm(model) and not list(model.buffers())
        assert has_batchnorm(build_model(name, 5, 3, 9))


def _train(model_name: str, splits: list[dict[int, int]], steps: int) -> torch.Tensor:
    """The flat state after ``steps`` server steps, each over 24 fresh samples split over
    workers as ``splits[step]`` says, combined with weighted-sync's weights."""
    torch.manual_seed(0)
    model = build_model(model_name, in_channels=6, num_classes=3, input_size=5)
    layout = FlatLayout(model)
    optimizer = FlatOptimizer("sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
    store = _whole_store(layout, optimizer)
    data = torch.Generator().manual_seed(1)
    task = 0
    for step in range(steps):
        x = torch.randn(24, 6, 5, 5, generator=data)
        y = torch.randint(0, 3, (24,), generator=data)
        sizes = splits[step]
        bounds = np.cumsum([0, *sizes.values()])
        ids = []
        for w, a, b in zip(sizes, bounds[:-1], bounds[1:], strict=True):
            task += 1
            store.stage(task, w, step, 0, 1.0, _local_push(model, layout, x[a:b], y[a:b]))
            ids.append(task)
        weights = WeightedSync.weights(None, sizes)  # type: ignore[arg-type]
        ok, reason = store.prepare(step + 1, ids, [weights[w] for w in sizes], 1.0, 1.0)
        assert ok, reason
        store.publish(step + 1)
        layout.write_state(store.state)
    return store.state.clone()


def test_with_group_norm_three_heterogeneous_workers_end_where_one_worker_ends() -> None:
    steps = 6
    one = [{1: 24}] * steps
    rng = np.random.default_rng(0)
    three = []  # speed-sized shares that change round to round, some tiny
    for _ in range(steps):
        speeds = {1: 1.0, 2: float(rng.uniform(0.2, 1)), 3: float(rng.uniform(0.05, 0.3))}
        three.append(plan_by_speed(speeds, 24))
    assert min(n for plan in three for n in plan.values()) <= 3
    single = _train("hsi-cnn-gn", one, steps)
    split = _train("hsi-cnn-gn", three, steps)
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-6)
    # the BatchNorm build does not have this property: its batch statistics follow the split
    assert not torch.allclose(
        _train("hsi-cnn", three, steps), _train("hsi-cnn", one, steps), atol=1e-3
    )


# --- the stability figure ----------------------------------------------------------------------


def test_max_drop_is_the_largest_fall_below_the_best_so_far_after_the_first_epoch() -> None:
    curve = [
        {"samples": 50, "oa": 0.6},
        {"samples": 100, "oa": 0.8},
        {"samples": 150, "oa": 0.5},  # after epoch 1 (100 samples): 0.3 below 0.8
        {"samples": 200, "oa": 0.9},
        {"samples": 250, "oa": 0.85},
    ]
    assert max_drop(curve, 100) == pytest.approx(0.3)
    assert max_drop(curve[3:], 100) == pytest.approx(0.05)
    assert max_drop([{"samples": 50, "oa": 0.9}, {"samples": 60, "oa": 0.1}], 100) is None
    runs = [
        {"mode": "ddp", "max_drop": 0.02},
        {"mode": "ddp", "max_drop": 0.06},
        {"mode": "ddp", "max_drop": 0.04},
        {"mode": "async", "max_drop": None},
    ]
    stats = drop_stats(runs, ("ddp", "async"))
    assert stats["ddp"] == {"median": pytest.approx(0.04), "max": pytest.approx(0.06)}
    assert stats["async"] is None
    data = {
        "settings": {
            "modes": ["ddp"],
            "dataset": "d.h5",
            "model": "hsi-cnn",
            "slowdowns": [1.0],
            "slowdown_schedules": [],
            "target_oa": 0.9,
            "repeats": 3,
            "train": {
                "global_batch": 64,
                "optimizer": "sgd",
                "lr": 0.05,
                "lr_schedule": "constant",
                "epochs": 3,
                "max_steps": None,
                "seed": 0,
            },
        },
        "runs": [
            {**r, "epoch_time_s": 1.0, "time_to_target_s": 2.0, "summary": {"final": {}}}
            for r in runs[:3]
        ],
    }
    table = render_markdown(data)
    assert "max OA drop" in RESULT_COLUMNS
    assert "0.020 / 0.040 / 0.060" in table


# --- end to end: a dataset whose size leaves a tail of a few samples ---------------------------
