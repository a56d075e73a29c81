"""The DDP baseline in real rank processes: training on Jasper Ridge, and no slowdown feedback."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.data.convert.synth import synth_scenes
from common.training.evaluator import EVAL_KEYS
from common.training.summary import SUMMARY_KEYS
from launch.cli import main
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.settings import TrainSettings


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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
