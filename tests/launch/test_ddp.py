"""The DDP baseline: the compute-only step, training on Jasper Ridge, and no slowdown feedback."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from common.data.convert.synth import synth_scenes
from common.errors import ConfigError
from common.protocol.base import MAX_INDICES
from common.training.evaluator import EVAL_KEYS
from common.training.slowdown import SlowdownSchedule
from common.training.summary import SUMMARY_KEYS
from launch.cli import main
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.ddp.step import ComputeOnlyStep
from launch.settings import TrainSettings
from pserver.config import ServerConfig


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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


@pytest.mark.e2e
@pytest.mark.realdata
def test_ddp_trains_on_jasper_ridge(jasper_h5: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "ddp"
    result = CliRunner().invoke(
        main,
        [
            "ddp",
            "--dataset",
            str(jasper_h5),
            "--model",
            "hsi-cnn",
            "--slowdowns",
            "1,2",
            "--epochs",
            "3",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "training: 100%" in result.stderr and "2892/2892" in result.stderr  # progress bar
    assert "epoch 3, version 48, OA 0." in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert tuple(summary)[: len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert summary["mode"] == "ddp" and summary["staleness"] is None
    assert summary["epochs"] == 3 and summary["samples_seen"] == 3 * 964
    assert summary["final"]["oa"] >= 0.85 and summary["final"]["kappa"] >= 0.78
    assert 0 < summary["train_time_s"] < summary["wall_time_s"]
    assert [w["samples"] for w in summary["workers"]] == [3 * 482, 3 * 482]
    events = _events(run_dir)
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["epoch"] for e in evals] == [1, 2, 3]
    assert all(set(EVAL_KEYS) <= set(e) for e in evals)
    assert [e["samples"] for e in evals] == [964, 1928, 2892]
    for name in ("join", "leave"):
        assert {e["worker"] for e in events if e["event"] == name} == {"r0-x1", "r1-x2"}
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == summary["steps"] == 3 * 16  # 964 = 15 x 64 + 4 per epoch
    assert all(sum(w["batch"] for w in r["workers"]) in (64, 4) for r in rounds)
    assert all({"worker", "batch", "speed"} <= set(w) for r in rounds for w in r["workers"])


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scenes") / "scenes32.h5"
    synth_scenes(out, samples=240, bands=8, size=32, classes=4, seed=2)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("slowdowns", [(1.0, 4.0), (2.0, 4.0)])
def test_compute_only_slowdown_does_not_feed_back(
    scenes: Path, tmp_path: Path, slowdowns: tuple[float, float]
) -> None:
    """Each rank's wait for the other is never scaled: a step lasts about the slowest rank's
    emulated compute, and the sleep is (F-1) times a compute time calibrated before training.

    If a rank timed its whole step (compute plus the all-reduce wait for the 4x rank) and
    slept in proportion, its measured compute would include the wait and the step time
    would grow from step to step; with slowdowns 2,4 that happens within a few steps.
    """
    run_dir = tmp_path / "ddp"
    config = DDPConfig(
        dataset=scenes,
        model="scene-cnn",
        slowdowns=slowdowns,
        run_dir=run_dir,
        train=TrainSettings(max_steps=24, global_batch=32),
    )
    summary = run_ddp(config)
    assert summary["steps"] == 24
    rounds = [e for e in _events(run_dir) if e["event"] == "round"][2:]  # past warm-up
    for rank, factor in enumerate(slowdowns):
        works = [r["workers"][rank] for r in rounds]
        batch = statistics.mode(w["batch"] for w in works)  # the full local batch
        compute = [w["compute_s"] for w in works if w["batch"] == batch]
        slept = [w["emulated_s"] - w["compute_s"] for w in works if w["batch"] == batch]
        # The same (F-1)·t̂ every step (metrics round to 1 µs), whatever this step measured.
        assert len(slept) >= len(rounds) // 2 and max(slept) - min(slept) < 1e-5, slept
        if factor == 1:
            assert max(slept) < 1e-5
        else:
            calibrated = statistics.median(slept) / (factor - 1)
            assert 0.2 < calibrated / statistics.median(compute) < 2.0, (calibrated, compute)
    # A rank's measured compute excludes its wait for the other (which would add 2-3x its
    # compute here): the two ranks compute equal batches, so their medians stay comparable.
    mine = [statistics.median(r["workers"][rank]["compute_s"] for r in rounds) for rank in (0, 1)]
    assert max(mine) < 2.5 * min(mine), mine
    ratios = [r["round_s"] / max(w["emulated_s"] for w in r["workers"]) for r in rounds]
    assert 0.7 < statistics.median(ratios) < 1.6, ratios
    third = len(ratios) // 3
    early, late = statistics.median(ratios[:third]), statistics.median(ratios[-third:])
    assert late < 1.5 * early, ratios
