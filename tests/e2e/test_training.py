"""End to end on real data: a server and heterogeneous worker processes on 127.0.0.1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.training.evaluator import EVAL_KEYS
from common.training.summary import SUMMARY_KEYS
from launch.local import LocalCluster, run_local
from tests.support.paths import ROOT

EPOCHS = 10


def _events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("mode", ["weighted-sync", "async"])
@pytest.mark.exclusive  # shares and staleness follow speeds
def test_jasper_ridge_three_heterogeneous_workers(
    jasper_h5: Path, tmp_path: Path, mode: str
) -> None:
    run_dir = tmp_path / mode
    cluster = LocalCluster(
        dataset=jasper_h5,
        model="hsi-cnn",
        mode=mode,
        slowdowns=(1.0, 2.0, 4.0),
        run_dir=run_dir,
        server_options=(
            "--epochs",
            str(EPOCHS),
            "--lr",
            "0.05",
            "--lr-schedule",
            "cosine",
            "--staleness",
            "inverse",
        ),
    )
    summary = run_local(cluster)

    assert tuple(summary)[: len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert summary["worker_exit_codes"] == [0, 0, 0]
    assert summary["final"]["oa"] >= 0.85, summary["final"]
    assert set(summary["final"]) == {"oa", "aa", "kappa", "loss"}
    assert summary["epochs"] == EPOCHS
    train_count = 964  # 10 % of Jasper Ridge's 9,639 labelled pixels
    assert summary["samples_seen"] == EPOCHS * train_count
    by_slowdown = {w["slowdown"]: w for w in summary["workers"]}
    assert set(by_slowdown) == {1.0, 2.0, 4.0}
    assert all(
        {"name", "slowdown", "speed", "samples", "pushes"} <= set(w) for w in summary["workers"]
    )
    for w in summary["workers"]:  # the fitted model of each worker (docs/run-files.md)
        assert set(w["model"]) == {"alpha_s", "beta_s_per_sample", "transfer_s"}
        assert w["model"]["beta_s_per_sample"] > 0 and w["model"]["alpha_s"] >= 0
    if mode == "weighted-sync":
        assert summary["staleness"] is None
        assert by_slowdown[1.0]["samples"] >= 2.5 * by_slowdown[4.0]["samples"]
        assert 0 <= summary["idle_share"] < 1
        assert all(w["idle_s"] >= 0 for w in summary["workers"])
        # slower workers pay the emulated slowdown per sample too
        beta = {f: by_slowdown[f]["model"]["beta_s_per_sample"] for f in by_slowdown}
        assert beta[1.0] < beta[4.0]
    else:
        assert summary["staleness"]["max"] >= 1 and summary["staleness"]["mean"] > 0
        assert summary["idle_share"] is None

    events = _events(run_dir)
    assert all({"event", "t"} <= set(e) for e in events)
    evals = [e for e in events if e["event"] == "eval"]
    # Evaluation takes the newest version and skips superseded ones; the last is the final one.
    eval_epochs = [e["epoch"] for e in evals]
    assert eval_epochs == sorted(eval_epochs) and eval_epochs[-1] == EPOCHS
    test_count = next(e for e in events if e["event"] == "start")["test"]
    assert evals[-1]["version"] == summary["steps"]
    assert evals[-1]["test_samples"] == test_count  # the final evaluation: whole test split
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)  # in time order
    assert all(set(EVAL_KEYS) <= set(e) for e in evals)
    epochs = [e for e in events if e["event"] == "epoch"]
    assert len(epochs) == EPOCHS
    assert all(e["exactly_once"] and e["samples"] == train_count for e in epochs)
    assert {e["worker"] for e in events if e["event"] == "join"} == {
        w["name"] for w in summary["workers"]
    }
    assert len([e for e in events if e["event"] == "leave"]) == 3
    per_update = [e for e in events if e["event"] in ("round", "push")]
    assert per_update and len(per_update) == summary["steps"]
    if mode == "async":
        assert all({"worker", "batch", "speed", "staleness"} <= set(e) for e in per_update)
    else:
        timed = {"worker", "batch", "speed", "compute_s", "transfer_s", "actual_s", "idle_s"}
        assert all(timed <= set(w) for e in per_update for w in e["workers"])
        idle = sum(w["idle_s"] for e in per_update for w in e["workers"])
        busy = sum(e["round_s"] * len(e["workers"]) for e in per_update)
        assert summary["idle_share"] == pytest.approx(idle / busy, abs=2e-3)
        for e in per_update:  # round = actual + idle + the server's step, for each worker
            for w in e["workers"]:
                assert w["actual_s"] == pytest.approx(w["compute_s"] + w["transfer_s"], abs=2e-6)
                total = w["actual_s"] + w["idle_s"] + e["step_s"]
                assert total == pytest.approx(e["round_s"], abs=1e-5)
        planned = [w for e in per_update[5:] for w in e["workers"]]
        assert all("predicted_s" in w for w in planned)  # calibrated: every plan has a model


def test_demo_runs_every_mode_and_prints_a_results_table(tmp_path: Path) -> None:
    shared = ROOT.parent / "shared"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.demo",
            "--shared",
            str(shared),
            "--out",
            str(tmp_path),
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "Results" in out
    table = out[out.index("Results") :].splitlines()
    for mode in ("weighted-sync", "equal-sync", "async"):
        row = next(line for line in table if line.startswith(mode))
        assert float(row.split()[4]) > 0.5  # OA column
    assert re.search(r"version \d+ \(epoch 2\.00\)", out)  # progress lines were shown
    plan = out[out.index("Each worker's share") :].splitlines()
    for mode in ("weighted-sync", "equal-sync", "async"):
        rows = [line.split() for line in plan if line.startswith(mode)]
        assert len(rows) == 3  # one per worker: slowdown, share, idle s, alpha, beta, transfer
        assert sum(float(r[2]) for r in rows) == pytest.approx(1.0, abs=0.01)
        assert all(float(r[4]) >= 0 and float(r[5]) > 0 for r in rows)
    assert "differ from slowdown ratios" in " ".join(out.split())  # the legend
