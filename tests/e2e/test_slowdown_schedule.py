"""Changing heterogeneity in a real run: weighted-sync follows a worker's new speed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.data.convert.synth import synth_scenes
from launch.cli import main

CHANGE_STEP = 12

SLOW = 5.0


def _share(record: dict, worker: str) -> float:
    batches = {w["worker"]: w["batch"] for w in record["workers"]}
    return batches.get(worker, 0) / sum(batches.values())


@pytest.mark.parametrize("planner", ["speed", "model"])
def test_weighted_sync_plan_follows_a_changed_speed(tmp_path: Path, planner: str) -> None:
    """Two equal workers; from its step 12 the second is 5x slower, and its batch share drops
    from about 1/2 to about 1/6 with the speed plan (both compute in proportion to their new
    speeds); the model plan may leave it out of rounds altogether (share 0), as the fast
    worker alone then finishes first. The model's robust fit over its last 32 pushes treats
    the first slow steps as outliers: it follows the change once they are about half of its
    window, so that plan is judged later (documented in docs/planner.md)."""
    settle = 8 if planner == "speed" else 20  # rounds after the change before judging
    steps = CHANGE_STEP + settle + 16
    data = tmp_path / "scenes.h5"
    synth_scenes(data, samples=160, bands=8, size=32, classes=4, seed=3)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        main,
        [
            "local",
            "--dataset",
            str(data),
            "--model",
            "scene-cnn",
            "--mode",
            "weighted-sync",
            "--slowdowns",
            "1,1",
            "--slowdown-schedules",
            f";{CHANGE_STEP}:{SLOW:g}",
            "--max-steps",
            str(steps),
            "--global-batch",
            "48",
            "--run-dir",
            str(run_dir),
            f"--server-opt=--planner={planner}",
            # scene-cnn has BatchNorm: the default minimum local batch (8) would leave the slow
            # worker's ~1/6 of 48 out of rounds; this test is about following the speed
            "--server-opt=--min-local-batch=1",
        ],
    )
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == steps
    assert all({"worker", "batch", "speed"} <= set(w) for r in rounds for w in r["workers"])
    names = [{w["worker"] for w in r["workers"]} for r in rounds]
    if planner == "speed":  # every worker gets at least one sample of every round
        assert all(len(n) == 2 for n in names)
    assert all("w0-x1" in n for n in names)
    before = rounds[2:CHANGE_STEP]  # the worker's steps 0..11 are rounds 1..12
    after = rounds[CHANGE_STEP + settle :]  # time for the speed average and planned rounds
    share_before = statistics.median(_share(r, "w1-x1") for r in before)
    share_after = statistics.median(_share(r, "w1-x1") for r in after)
    assert 0.3 < share_before < 0.7, share_before
    assert share_after < 0.3 and share_after < share_before - 0.15, (share_before, share_after)

    def speed(records: list[dict], name: str) -> float:
        return statistics.median(
            w["speed"] for r in records for w in r["workers"] if w["worker"] == name
        )

    if planner == "model" and not any("w1-x1" in n for n in names[CHANGE_STEP + settle :]):
        return  # left out since its slowdown: nothing more to measure
    slowed = speed(before, "w1-x1") / speed(after, "w1-x1")
    assert slowed > 2.5, slowed  # the server saw the worker become about 5x slower
