"""One rule for run folders in ``pslaunch local``: a failed start leaves nothing the corrected
start refuses, a refusal touches nothing, ``--resume``/``--overwrite`` exist, and a worker
killed during a run is told apart from a failed launch."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from common.errors import PSError
from common.procs import Child
from launch.local import LocalCluster, run_local
from tests.support.launches import MARK, processes_marked, wait_for_training
from tests.support.paths import ROOT

WAIT_S = 180.0


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch) -> str:
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARK, value)
    return value


def _pslaunch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "local", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=WAIT_S,
    )


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_failed_start_leaves_nothing_the_corrected_start_refuses(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    run_dir = tmp_path / "run"
    options = ("--epochs", "1", "--shutdown-timeout", "30")
    failed = LocalCluster(
        dataset=small_hsi,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 1.0),
        run_dir=run_dir,
        server_options=options,
        devices=("cuda:0", "cpu"),
    )
    with pytest.raises(PSError, match="CUDA"):
        run_local(failed)
    corrected = LocalCluster(
        dataset=small_hsi,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 1.0),
        run_dir=run_dir,
        server_options=options,
    )
    summary = run_local(corrected)
    assert summary["steps"] > 0 and summary["final"] is not None
    assert processes_marked(mark) == []
    # the finished run: --resume is taken (it only writes the summary again), a plain start not
    resumed = _pslaunch(
        *("--dataset", str(small_hsi), "--model", "hsi-cnn", "--slowdowns", "1,1"),
        *("--epochs", "1", "--run-dir", str(run_dir), "--no-progress", "--resume"),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == summary["steps"]
    assert processes_marked(mark) == []


def test_a_refusal_touches_nothing_not_even_the_launch_log(small_hsi: Path, tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"event": "start", "t": 0}\n{"event": "round", "t": 1, "version": 1}\n'
    )
    (tmp_path / "summary.json").write_text('{"steps": 1}')
    (tmp_path / "cluster.log").write_text("the finished run's log\n")
    before = _snapshot(tmp_path)
    done = _pslaunch(
        *("--dataset", str(small_hsi), "--model", "hsi-cnn", "--epochs", "1"),
        *("--run-dir", str(tmp_path)),
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"Error: --run-dir {tmp_path} already holds a run (metrics.jsonl, summary.json); give "
        "--resume to continue it or --overwrite to replace it"
    ]
    assert done.stdout == ""
    assert _snapshot(tmp_path) == before


def test_a_budget_refusal_is_one_line_before_any_bar_or_file(
    small_hsi: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = _pslaunch(
        *("--dataset", str(small_hsi), "--model", "hsi-cnn", "--epochs", "1"),
        *("--node-cpus", "500,500", "--server-cpus", "1", "--run-dir", str(run_dir)),
    )
    assert done.returncode == 1
    assert done.stderr.startswith("Error: the CPU budgets sum to 1001 cores"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
    assert not run_dir.exists()


@pytest.mark.exclusive  # --dead-after 2 against compute time
def test_a_worker_killed_during_the_run_is_reported_and_the_results_printed(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    run_dir = tmp_path / "run"
    launcher = Child(
        "pslaunch",
        [
            *(sys.executable, "-m", "launch.cli", "local", "--dataset", str(small_hsi)),
            *("--model", "hsi-cnn", "--mode", "async", "--slowdowns", "1,2", "--epochs", "60"),
            *("--run-dir", str(run_dir), "--no-progress", "--server-opt=--dead-after=2"),
            *("--restarts", "0"),  # reported as gone, not restarted
        ],
        cwd=ROOT,
    )
    try:
        wait_for_training(run_dir, launcher, WAIT_S)
        victim = next(
            psutil.Process(pid)
            for pid in processes_marked(mark)
            if "w1-x2" in psutil.Process(pid).cmdline()
        )
        victim.send_signal(signal.SIGKILL)
        code = launcher.wait(WAIT_S)
    finally:
        launcher.kill()
    out = launcher.output()
    assert code == 0, out
    assert re.search(r"w1-x2 was killed by SIGKILL \(signal 9\) during the run; the server", out)
    assert "exited with code -9" not in out
    assert f"summary: {run_dir / 'summary.json'}" in out
    assert re.search(r"^mode\s+epochs\s+updates", out, re.MULTILINE), out
    assert processes_marked(mark) == []
