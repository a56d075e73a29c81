"""The DDP baseline: the compute-only step, training on Jasper Ridge, and no slowdown feedback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from common.protocol.base import MAX_INDICES
from common.training.slowdown import SlowdownSchedule
from launch.ddp.launcher import DDPConfig
from launch.ddp.step import ComputeOnlyStep
from launch.settings import TrainSettings
from pserver.config import ServerConfig


def _linear_step(rank: int, world: int, reduce) -> tuple[nn.Module, ComputeOnlyStep]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    step = ComputeOnlyStep(
        model, model, rank, world, torch.device("cpu"), SlowdownSchedule(1.0), reduce
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


def test_warm_up_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 5, 5))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    step = ComputeOnlyStep(
        model, model, 0, 1, torch.device("cpu"), SlowdownSchedule(3.0), lambda t: None
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
    with pytest.raises(ConfigError, match="STEP:FACTOR"):
        DDPConfig(
            data, "hsi-cnn", (1.0,), tmp_path, TrainSettings(epochs=1), slowdown_schedules=("x",)
        ).validate()


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
        ServerConfig(Path("data.h5"), "hsi-cnn", **values)
    assert str(from_ddp.value) == str(from_server.value)
