"""The DDP baseline in real rank processes: training on Jasper Ridge, and no slowdown feedback."""

from __future__ import annotations

import json
import signal
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from common.data.convert.synth import synth_hsi, synth_scenes
from common.polling import poll_until
from common.procs import Child
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
@pytest.mark.exclusive  # compares step times
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


@pytest.fixture(scope="module")
def hsi_153(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hsi") / "hsi.h5"
    synth_hsi(out, bands=8, size=24, classes=3, patch=5, train_fraction=0.3, seed=1)
    return out  # 153 training samples: 19 steps of 8 and a tail of 1 per epoch


def _final_state(run_dir: Path) -> np.ndarray:
    newest = max((run_dir / "snapshots").glob("snap-*.npz"))
    with np.load(newest) as data:
        return data["state"]


def test_weighted_ddp_on_uneven_ranks_ends_where_one_process_ends(
    hsi_153: Path, tmp_path: Path
) -> None:
    """Ranks computing 5, 2, 1 and 0 of every 8 samples (GroupNorm, fp32) apply the updates
    one process computing all 8 applies: same final parameters and test loss."""
    runs = {}
    for name, slowdowns, extra in (
        ("one", "1", []),
        ("weighted", "1,1,1,1", ["--weighted", "--shares", "5,2,1,0"]),
    ):
        runs[name] = tmp_path / name
        args = ["ddp", "--dataset", str(hsi_153), "--model", "hsi-cnn", "--norm", "group"]
        args += ["--slowdowns", slowdowns, "--epochs", "2", "--global-batch", "8"]
        args += ["--snapshot-every-steps", "1000", "--run-dir", str(runs[name]), *extra]
        result = CliRunner().invoke(main, [*args, "--no-progress"])
        assert result.exit_code == 0, result.output
    one, weighted = (json.loads((runs[n] / "summary.json").read_text()) for n in runs)
    assert weighted["mode"] == "weighted-ddp" and one["mode"] == "ddp"
    assert weighted["steps"] == one["steps"] == 40
    assert abs(weighted["final"]["loss"] - one["final"]["loss"]) <= 1e-6
    np.testing.assert_allclose(
        _final_state(runs["weighted"]), _final_state(runs["one"]), rtol=1e-5, atol=1e-6
    )
    assert [w["samples"] for w in weighted["workers"]] == [5 * 38 + 2, 2 * 38, 38, 0]
    events = _events(runs["weighted"])
    assert [e["mode"] for e in events if e["event"] == "start"] == ["weighted-ddp"]
    shares = [e for e in events if e["event"] == "shares"]
    assert [[w["batch"] for w in e["workers"]] for e in shares] == [[5, 2, 1, 0]]
    rounds = [[w["batch"] for w in e["workers"]] for e in events if e["event"] == "round"]
    assert rounds.count([5, 2, 1, 0]) == 38 and rounds.count([1, 0, 0, 0]) == 2  # the tails
    for epoch in (e for e in events if e["event"] == "epoch"):
        assert epoch["samples"] == 153 and epoch["exactly_once"]


@pytest.mark.exclusive  # shares follow measured speeds
def test_weighted_ddp_measures_its_shares_and_rebalances_each_epoch(
    hsi_153: Path, tmp_path: Path
) -> None:
    """Without --shares the ranks time a probe batch: the rank slowed 4x gets the smaller part;
    --rebalance epoch splits again from the first epoch's step times."""
    config = DDPConfig(
        dataset=hsi_153,
        model="hsi-cnn",
        slowdowns=(1.0, 4.0),
        run_dir=tmp_path / "run",
        train=TrainSettings(epochs=2, global_batch=16),
        weighted=True,
        rebalance="epoch",
    )
    summary = run_ddp(config)
    events = _events(config.run_dir)
    shares = [e for e in events if e["event"] == "shares"]
    assert [e["source"] for e in shares] == ["probe", "epoch"]
    for split in shares:
        fast, slow = (w["batch"] for w in split["workers"])
        assert fast + slow == 16 and fast > 2 * slow, split
    assert summary["details"]["shares"] == [w["batch"] for w in shares[-1]["workers"]]
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["samples"] for e in epochs] == [153, 153]


def _ddp(hsi_153: Path, run_dir: Path, *extra: str) -> list[str]:
    args = ["ddp", "--dataset", str(hsi_153), "--model", "hsi-cnn", "--slowdowns", "1,1"]
    return [*args, "--global-batch", "16", "--run-dir", str(run_dir), "--no-progress", *extra]


def _listing(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(run_dir.rglob("*"))
    }


def test_a_run_folder_is_refused_then_overwritten_or_resumed(hsi_153: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    failed = CliRunner().invoke(main, _ddp(hsi_153, run_dir, "--epochs", "1", "--devices", "x"))
    assert failed.exit_code != 0  # a failed start leaves nothing a corrected start refuses
    first = CliRunner().invoke(main, _ddp(hsi_153, run_dir, "--epochs", "1"))
    assert first.exit_code == 0, first.output
    before = _listing(run_dir)
    assert "checkpoints/ckpt-0000000010.npz" in before  # 153 samples: 10 steps of 16
    again = CliRunner().invoke(main, _ddp(hsi_153, run_dir, "--epochs", "1"))
    assert again.exit_code != 0
    assert "already holds a run" in again.output and "--overwrite" in again.output
    assert _listing(run_dir) == before  # the refusal touched nothing
    resumed = CliRunner().invoke(main, _ddp(hsi_153, run_dir, "--epochs", "2", "--resume"))
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["epochs"] == 2 and summary["samples_seen"] == 306
    assert [w["samples"] for w in summary["workers"]] == [2 * 77, 2 * 76]  # both runs' samples
    events = _events(run_dir)
    assert [e["event"] for e in events].count("start") == 2
    assert next(e for e in events if e["event"] == "resume")["samples"] == 153
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2]
    assert [e["version"] for e in events if e["event"] == "eval"] == [10, 20]
    ts = [e["t"] for e in events]
    assert ts == sorted(ts)  # one clock, going on from the checkpoint
    replaced = CliRunner().invoke(main, _ddp(hsi_153, run_dir, "--epochs", "1", "--overwrite"))
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 10
    assert [e["event"] for e in _events(run_dir)].count("start") == 1


def test_ctrl_c_stops_ddp_with_a_summary_and_a_checkpoint(hsi_153: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launch.cli", *_ddp(hsi_153, run_dir, "--epochs", "500")]
    launcher = Child("pslaunch", [*argv, "--slowdowns", "1,3"])
    try:
        poll_until(
            lambda: any(e["event"] == "round" for e in _events_so_far(run_dir)),
            120,
            0.2,
            "a round event",
        )
        launcher.popen.send_signal(signal.SIGINT)  # Ctrl-C reaches only the launcher
        assert launcher.wait(timeout=60) == 130
    finally:
        launcher.kill()
    assert f"summary: {run_dir / 'summary.json'}" in launcher.output()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finish_reason"] == "interrupted" and 0 < summary["steps"] < 5000
    saved = sorted((run_dir / "checkpoints").glob("ckpt-*.npz"))
    assert saved[-1].name == f"ckpt-{summary['steps']:010d}.npz"  # where it stopped
    leaves = [e for e in _events(run_dir) if e["event"] == "leave"]
    assert len(leaves) == 2


def _events_so_far(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]
