"""The DDP baseline: the compute-only step, training on Jasper Ridge, and no slowdown feedback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from common.protocol.base import MAX_INDICES
from common.training.planner import plan_batches
from common.training.slowdown import SlowdownSchedule
from launch.cluster.spec import parse_cluster
from launch.ddp.launcher import DDPConfig
from launch.ddp.step import ComputeOnlyStep
from launch.settings import TrainSettings
from pserver.config import ServerConfig


def _linear_step(rank: int, world: int, reduce) -> tuple[nn.Module, ComputeOnlyStep]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    step = ComputeOnlyStep(
        model,
        model,
        rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        schedule=SlowdownSchedule(1.0),
        all_reduce=reduce,
    )
    return model, step


def test_step_averages_like_one_global_batch() -> None:
    """Two ranks with equal halves: the mean of their gradients is the union's gradient."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    sent: list[torch.Tensor] = []
    _, rank1 = _linear_step(1, 2, lambda t: sent.append(t.clone()))
    rank1.run(0, x[4:], y[4:])
    model0, rank0 = _linear_step(0, 2, lambda t: t.add_(sent[0]))
    result = rank0.run(0, x[:4], y[:4])
    reference = nn.Linear(4, 3)
    reference.load_state_dict(model0.state_dict())
    nn.functional.cross_entropy(reference(x), y).backward()
    torch.testing.assert_close(model0.weight.grad, reference.weight.grad)
    torch.testing.assert_close(model0.bias.grad, reference.bias.grad)
    assert result.active == 2
    assert result.compute_s[0] > 0 and result.compute_s[1] > 0
    assert result.emulated_s == result.compute_s  # slowdown 1 everywhere


class _Tracked(nn.Module):
    """A small classifier beside a BatchNorm that only tracks statistics of its input, so the
    gradient of a split batch can equal the whole batch's while the statistics still move."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.stats = nn.BatchNorm2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats(x.view(-1, 1, 2, 2))
        return self.body(x)


@pytest.mark.parametrize("sizes", [(5, 2, 1), (4, 0, 3)])
def test_weighted_step_with_uneven_shares_is_the_union_gradient(sizes: tuple[int, ...]) -> None:
    """Ranks with b = 5, 2, 1 (or one rank with none) of 8 samples: the sum of (b_r / b) g_r is
    the gradient of the 8 samples, the BatchNorm statistics move by the b_r / b-weighted
    changes, and an epoch's tail is then weighted b / B."""
    gen = torch.Generator().manual_seed(1)
    total, batch = sum(sizes), 64
    x, y = torch.randn(total, 4, generator=gen), torch.randint(0, 3, (total,), generator=gen)
    bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]

    def model() -> _Tracked:
        torch.manual_seed(0)
        return _Tracked()

    sent: list[torch.Tensor] = []
    for rank in range(1, len(sizes)):
        replica = model()
        step = ComputeOnlyStep(
            replica,
            replica,
            rank=rank,
            world_size=len(sizes),
            device=torch.device("cpu"),
            schedule=SlowdownSchedule(1.0),
            all_reduce=lambda t: sent.append(t.clone()),
        )
        part = slice(bounds[rank], bounds[rank + 1])
        step.run(0, x[part], y[part], total / batch, weight=sizes[rank] / total)
    mine = model()
    step = ComputeOnlyStep(
        mine,
        mine,
        rank=0,
        world_size=len(sizes),
        device=torch.device("cpu"),
        schedule=SlowdownSchedule(1.0),
        all_reduce=lambda t: t.add_(sum(sent)),
    )
    before = mine.stats.running_mean.clone()
    result = step.run(0, x[: sizes[0]], y[: sizes[0]], total / batch, weight=sizes[0] / total)
    assert result.active == sum(1 for b in sizes if b)
    reference = model()
    nn.functional.cross_entropy(reference(x), y).backward()
    for got, full in zip(mine.body.parameters(), reference.body.parameters(), strict=True):
        torch.testing.assert_close(got.grad, full.grad * total / batch)
    moved = torch.zeros_like(before)
    for rank, size in enumerate(sizes):
        if size:
            alone = model()  # each rank's own BatchNorm move, weighted by its share
            alone(x[bounds[rank] : bounds[rank + 1]])
            moved += size / total * (alone.stats.running_mean - before)
    torch.testing.assert_close(mine.stats.running_mean, before + moved * total / batch)


def test_weighted_shares_sum_to_the_batch_by_largest_remainder_and_may_be_zero() -> None:
    speeds = {0: 0.4, 1: 0.4, 2: 0.2, 3: 0.001}
    # 8 x shares = 3.197, 3.197, 1.598, 0.008: floors 3, 3, 1, 0; the one left goes to the
    # largest remainder (rank 2); rank 3 keeps 0, where the parameter server's plan lends it one
    assert plan_batches(speeds, 8, every_worker=False) == {0: 3, 1: 3, 2: 2, 3: 0}
    assert plan_batches(speeds, 8) == {0: 2, 1: 3, 2: 2, 3: 1}
    for total in range(1, 70):
        plan = plan_batches(speeds, total, every_worker=False)
        assert sum(plan.values()) == total
        assert all(abs(n - total * speeds[r] / 1.001) < 1 for r, n in plan.items())


def test_warm_up_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 5, 5))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    step = ComputeOnlyStep(
        model,
        model,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        schedule=SlowdownSchedule(3.0),
        all_reduce=lambda t: None,
    )
    calibrated = step.warm_up(torch.randn(6, 3, 5, 5), torch.randint(0, 2, (6,)), sizes={3, 6, 9})
    assert set(calibrated) == {3, 6} and all(t > 0 for t in calibrated.values())  # 9 > 6: none
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, state[key])
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())


def test_config_rejects_bad_values(tmp_path: Path) -> None:
    data = tmp_path / "missing.h5"
    with pytest.raises(ConfigError, match="--epochs"):
        DDPConfig(data, "hsi-cnn", (1.0,), tmp_path, TrainSettings()).validate()
    with pytest.raises(ConfigError, match="nccl"):
        DDPConfig(
            data, "hsi-cnn", (1.0,), tmp_path, TrainSettings(epochs=1), backend="nccl"
        ).validate()
    good, data = TrainSettings(epochs=1), tmp_path / "present.h5"
    data.touch()
    for shares, rebalance in (((1.0, 1.0), "none"), ((), "epoch")):  # without --weighted
        with pytest.raises(ConfigError, match="--weighted"):
            DDPConfig(
                data, "hsi-cnn", (1.0, 1.0), tmp_path, good, shares=shares, rebalance=rebalance
            ).validate()
    for shares in ((1.0,), (1.0, -1.0), (0.0, 0.0), (1.0, float("nan"))):
        with pytest.raises(ConfigError, match="--shares '"):
            DDPConfig(
                data, "hsi-cnn", (1.0, 1.0), tmp_path, good, weighted=True, shares=shares
            ).validate()
    alone = parse_cluster(1, node_cpus="0.4;off@30%;on@60%")
    with pytest.raises(ConfigError, match="keep one node on"):
        DDPConfig(data, "hsi-cnn", (1.0,), tmp_path, good, nodes=alone).validate()
    with pytest.raises(ConfigError, match="STEP:FACTOR"):
        DDPConfig(
            data, "hsi-cnn", (1.0,), tmp_path, TrainSettings(epochs=1), slowdown_schedules=("x",)
        ).validate()


def test_a_subset_of_ranks_keeps_each_node_s_name_slowdown_and_share(tmp_path: Path) -> None:
    config = DDPConfig(
        tmp_path / "d.h5",
        "hsi-cnn",
        (1.0, 1.0, 40.0),
        tmp_path,
        TrainSettings(epochs=1),
        weighted=True,
        shares=(3.0, 2.0, 1.0),
    )
    kept = config.subset([1, 2])
    assert [kept.rank_name(r) for r in range(2)] == ["r1-x1", "r2-x40"]
    assert kept.slowdowns == (1.0, 40.0) and kept.shares == (2.0, 1.0)


@pytest.mark.parametrize(
    ("settings", "option"),
    [
        ({"lr": float("nan")}, "--lr"),
        ({"lr": float("inf")}, "--lr"),
        ({"weight_decay": float("nan")}, "--weight-decay"),
        ({"global_batch": MAX_INDICES + 1}, "--global-batch"),
    ],
)
def test_ddp_settings_follow_the_server_rules(settings: dict, option: str) -> None:
    """The DDP baseline refuses what ``pserver start`` refuses, with the same message."""
    values = {"epochs": 1, **settings}
    with pytest.raises(ConfigError, match=option) as from_ddp:
        TrainSettings(**values).validate()
    with pytest.raises(ConfigError) as from_server:
        ServerConfig(dataset=Path("data.h5"), model="hsi-cnn", **values)
    assert str(from_ddp.value) == str(from_server.value)
