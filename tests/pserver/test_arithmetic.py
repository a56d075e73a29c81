"""Policy arithmetic against hand computations: combination, staleness, planning, sampling,
and the flat optimizer against torch.optim."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from common.training.flat import FlatLayout
from common.training.models import build_model
from common.training.planner import plan_batches, plan_equal
from common.training.schedule import lr_factor, progress
from pserver.policies.equal_sync import EqualSync
from pserver.policies.staleness import staleness_function
from pserver.policies.weighted_sync import WeightedSync
from pserver.sampler import EpochSampler
from pserver.store.optimizer import FlatOptimizer
from pserver.store.slices import SliceStore
from tests.support.pushes import push_of


def _model_and_batch(n: int = 24) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("hsi-cnn", in_channels=8, num_classes=3, input_size=5).eval()
    x = torch.randn(n, 8, 5, 5)
    y = torch.randint(0, 3, (n,))
    return model, x, y


def _mean_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    layout = FlatLayout(model)
    before = layout.read_state()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return push_of(layout, before)


def _store(state: torch.Tensor, num_params: int, optimizer: FlatOptimizer) -> SliceStore:
    return SliceStore(
        0,
        state.numel(),
        num_params=num_params,
        state=state,
        optimizer=optimizer,
        nonneg_bounds=[],
        chunk_elems=1 << 20,
    )


def _step(store: SliceStore, grads: dict[int, torch.Tensor], weights: dict[int, float]) -> None:
    """Stage one push per worker id, then apply their weighted sum as version 1."""
    for wid, grad in grads.items():
        store.stage(wid, wid, 0, 0, 1.0, grad)
    ok, reason = store.prepare(1, sorted(grads), [weights[w] for w in sorted(grads)], 1.0, 1.0)
    assert ok, reason
    store.publish(1)


def _combine(policy_cls, sizes: dict[int, int], grads: dict[int, torch.Tensor]) -> torch.Tensor:
    """The combined gradient a policy's weights give (read off one SGD step with lr 1)."""
    size = next(iter(grads.values())).numel()
    store = _store(torch.zeros(size), size, FlatOptimizer("sgd", lr=1.0))
    _step(store, grads, policy_cls.weights(None, sizes))
    return -store.state


def test_weighted_sync_equals_the_gradient_of_the_union_batch() -> None:
    model, x, y = _model_and_batch(24)
    sizes = {1: 13, 2: 8, 3: 3}  # b_i from speeds 13:8:3, sum B = 24
    bounds = np.cumsum([0, *sizes.values()])
    grads = {
        wid: _mean_gradient(model, x[a:b], y[a:b])
        for wid, a, b in zip(sizes, bounds[:-1], bounds[1:], strict=True)
    }
    combined = _combine(WeightedSync, sizes, grads)
    union = _mean_gradient(model, x, y)
    torch.testing.assert_close(combined, union, rtol=1e-5, atol=1e-6)
    plain_mean = sum(grads.values()) / 3
    assert not torch.allclose(plain_mean, union, atol=1e-4)  # the weighting matters


def test_equal_sync_is_the_plain_mean() -> None:
    grads = {1: torch.tensor([1.0, 2.0]), 2: torch.tensor([3.0, -2.0]), 3: torch.tensor([5.0, 6.0])}
    combined = _combine(EqualSync, {1: 4, 2: 4, 3: 3}, grads)
    torch.testing.assert_close(combined, torch.tensor([3.0, 2.0]))


def test_weighted_step_on_the_server_equals_a_single_process_sgd_step() -> None:
    model, x, y = _model_and_batch(20)
    layout = FlatLayout(model)
    start = layout.read_state()
    optimizer = FlatOptimizer("sgd", lr=0.1, momentum=0.9, weight_decay=1e-3)
    store = _store(start.clone(), layout.num_params, optimizer)
    sizes = {1: 15, 2: 5}
    grads = {1: _mean_gradient(model, x[:15], y[:15]), 2: _mean_gradient(model, x[15:], y[15:])}
    _step(store, grads, WeightedSync.weights(None, sizes))

    reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    reference.step()
    torch.testing.assert_close(store.state, layout.read_state(), rtol=1e-5, atol=1e-6)
    assert store.version == 1


@pytest.mark.parametrize(
    ("kind", "a", "b", "expected"),
    [
        ("inverse", 0.5, 4.0, [1.0, 1 / 2, 1 / 3, 1 / 5, 1 / 11]),
        ("poly", 0.5, 4.0, [1.0, 2**-0.5, 3**-0.5, 5**-0.5, 11**-0.5]),
        ("hinge", 0.5, 2.0, [1.0, 1.0, 1.0, 1 / (0.5 * 2 + 1), 1 / (0.5 * 8 + 1)]),
        ("exp", 0.5, 4.0, [1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-2.0), math.exp(-5.0)]),
        ("constant", 0.5, 4.0, [1.0] * 5),
    ],
)
def test_staleness_functions_match_hand_values(kind, a, b, expected) -> None:
    f = staleness_function(kind, a, b)
    assert [f(tau) for tau in (0, 1, 2, 4, 10)] == pytest.approx(expected)


def test_planner_sums_to_the_global_batch_and_follows_speeds() -> None:
    sizes = plan_batches({1: 400.0, 2: 200.0, 3: 100.0}, 70)
    assert sum(sizes.values()) == 70 and sizes == {1: 40, 2: 20, 3: 10}
    lopsided = plan_batches({1: 10_000.0, 2: 1.0}, 8)
    assert lopsided == {1: 7, 2: 1}  # everyone gets at least one sample
    assert plan_batches({1: 1.0, 2: 5.0, 3: 2.0}, 2) == {2: 1, 3: 1}  # B < N: the fastest
    assert plan_equal([1, 2, 3], 10) == {1: 4, 2: 3, 3: 3}
    rng = np.random.default_rng(0)
    for _ in range(200):
        speeds = {w: float(rng.uniform(1, 1000)) for w in range(int(rng.integers(1, 9)))}
        total = int(rng.integers(len(speeds), 500))
        sizes = plan_batches(speeds, total)
        assert sum(sizes.values()) == total and min(sizes.values()) >= 1
        order = sorted(speeds, key=speeds.get)
        assert all(sizes[a] <= sizes[b] + 1 for a, b in itertools.pairwise(order))


def test_every_sample_is_used_exactly_once_per_epoch_while_speeds_change() -> None:
    rng = np.random.default_rng(3)
    sampler = EpochSampler(num_samples=257, seed=0, max_epochs=4)
    finished = []
    while not sampler.exhausted:
        speeds = {w: float(rng.uniform(1, 100)) for w in range(3)}  # new speeds every round
        total = min(32, sampler.remaining_in_epoch())
        epoch, positions = sampler.take(total)
        offset = 0
        for wid, n in plan_batches(speeds, total).items():
            chunk = positions[offset : offset + n]
            offset += n
            if wid == 2 and rng.random() < 0.1:  # this worker vanishes: its share is re-issued
                sampler.give_back(epoch, chunk)
                continue
            ledger = sampler.record_applied(epoch, chunk)
            if ledger.complete:
                assert (ledger.uses == 1).all()
                finished.append(epoch)
                sampler.forget(epoch)
    assert finished == [1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["sgd", "nesterov", "adam"])
def test_flat_optimizer_matches_torch_optim(kind) -> None:
    torch.manual_seed(1)
    params = torch.randn(50)
    mine = FlatOptimizer(
        "adam" if kind == "adam" else "sgd",
        lr=0.01,
        momentum=0.9,
        nesterov=kind == "nesterov",
        weight_decay=0.01,
    )
    ref_param = nn.Parameter(params.clone())
    if kind == "adam":
        reference = torch.optim.Adam([ref_param], lr=0.01, weight_decay=0.01)
    else:
        reference = torch.optim.SGD(
            [ref_param], lr=0.01, momentum=0.9, nesterov=kind == "nesterov", weight_decay=0.01
        )
    current = params.clone()
    for _ in range(5):
        grad = torch.randn(50)
        new = torch.empty_like(current)
        before = current.clone()
        mine.publish(mine.prepare(current, grad, new))
        assert torch.equal(current, before)  # copy-on-step: the old snapshot is untouched
        current = new
        ref_param.grad = grad
        reference.step()
    torch.testing.assert_close(current, ref_param.detach(), rtol=1e-5, atol=1e-7)


def test_lr_schedules() -> None:
    assert lr_factor("constant", 0.7) == 1.0
    assert lr_factor("cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor("cosine", 0.5) == pytest.approx(0.5)
    assert lr_factor("cosine", 1.0) == pytest.approx(0.0)
    assert lr_factor("step", 0.6) == pytest.approx(0.1)
    assert lr_factor("step", 0.8) == pytest.approx(0.01)
    assert lr_factor("constant", 0.05, warmup_fraction=0.1) == pytest.approx(0.5)
    # progress: by updates under a step limit, else by samples over all epochs
    assert progress(30, 999, 100, max_steps=120, epochs=5) == pytest.approx(0.25)
    assert progress(30, 150, 100, max_steps=None, epochs=5) == pytest.approx(0.3)
    assert progress(30, 150, 100, max_steps=None, epochs=None) == 0.0
