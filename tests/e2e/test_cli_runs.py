"""``pslaunch local`` as a process: two shards train Jasper Ridge and leave nothing, a run dir
taken twice with ``--overwrite``, a stopped launch reaping its shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from tests.support.launches import (
    MARK,
    processes_marked,
    start_pslaunch,
    stop_launcher,
    wait_for_training,
)
from tests.support.paths import ROOT


def test_pslaunch_local_with_two_shards_trains_jasper_ridge_and_leaves_nothing(
    jasper_h5: Path, tmp_path: Path
) -> None:
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    env = {**os.environ, MARK: mark, "PSLAUNCH_LOCAL_SHARDS": "2"}  # set through its variable
    done = subprocess.run(
        [
            sys.executable, "-m", "launch.cli", "local", "--dataset", str(jasper_h5),
            "--model", "hsi-cnn", "--mode", "weighted-sync", "--slowdowns", "1,2,4",
            "--epochs", "8", "--lr", "0.05", "--lr-schedule", "cosine", "--run-dir",
            str(run_dir), "--server-opt=--shutdown-timeout=60",
        ],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "and 2 shards" in done.stdout
    assert "training: 100%" in done.stderr and "epoch 8" in done.stderr  # the progress bar
    assert processes_marked(mark) == []
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["details"]["shards"] == 2
    assert summary["final"]["oa"] >= 0.85, summary["final"]
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    events = [json.loads(line) for line in lines]
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(1, 9))
    assert all(e["exactly_once"] for e in epochs)
    log = (run_dir / "cluster.log").read_text(encoding="utf-8")
    assert "[shard0]" in log and "[shard1]" in log


def test_pslaunch_local_runs_twice_in_one_run_dir_with_overwrite(
    small_hsi: Path, tmp_path: Path
) -> None:
    args = ["local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--slowdowns", "1,2"]
    args += ["--epochs", "2", "--run-dir", str(tmp_path), "--no-progress"]
    command = [sys.executable, "-m", "launch.cli", *args]
    first = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert refused.returncode == 1 and "--overwrite" in refused.stderr
    again = subprocess.run(
        [*command, "--overwrite"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "share:" in again.stdout and "w1-x2" in again.stdout
    events = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    starts = [line for line in events if '"event": "start"' in line]
    assert len(starts) == 1  # the first run's files were replaced, not continued


def test_a_stopped_launch_with_shards_stops_and_reaps_them(small_hsi: Path, tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    launcher = start_pslaunch(
        "local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--mode", "async",
        "--slowdowns", "1,2", "--epochs", "1000", "--shards", "2", "--run-dir", str(run_dir),
        "--server-opt=--shutdown-timeout=30",
        env={**os.environ, MARK: mark},
    )  # fmt: skip
    try:
        wait_for_training(run_dir, launcher, 120)
        assert len(processes_marked(mark)) == 6  # pslaunch, server, 2 shards, 2 workers
    except BaseException:
        launcher.kill()
        raise
    code = stop_launcher(launcher, lambda: launcher.popen.send_signal(signal.SIGTERM), 120)
    assert code == 130, launcher.tail()
    assert processes_marked(mark) == []
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["finish_reason"] == "stopped" and summary["details"]["shards"] == 2
