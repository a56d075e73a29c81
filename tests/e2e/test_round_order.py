"""An update's workers get their next tasks before the update is booked, and the updates that
may end training are booked first (their workers are told to stop instead)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common import stagetrace
from launch.local import LocalCluster, run_local


@pytest.mark.parametrize("mode", ["weighted-sync", "async"])
def test_replies_go_out_before_booking_except_where_training_may_end(
    small_hsi: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv(stagetrace.ENV, str(tmp_path / "trace"))
    cluster = LocalCluster(
        dataset=small_hsi,
        model="hsi-cnn",
        mode=mode,
        slowdowns=(1.0,),
        run_dir=tmp_path / "run",
        server_options=("--epochs", "2", "--global-batch", "32"),
        run_timeout_s=240.0,
    )
    summary = run_local(cluster)
    (trace,) = (tmp_path / "trace").glob("server-*.jsonl")
    marks = [json.loads(line) for line in trace.read_text().splitlines()]
    updates: list[list[str]] = []  # per published update: its marks up to the next one
    for mark in marks:
        if mark["ev"] == "c_applied":
            updates.append([])
        elif updates and mark["ev"] in ("reply", "c_booked"):
            updates[-1].append(mark["ev"] if mark["ev"] == "c_booked" else mark["type"])
    answered_first = [r for r in updates if r[:2] == ["task_params_reply", "c_booked"]]
    booked_first = [r for r in updates if r and r[0] == "c_booked"]
    assert len(updates) == summary["steps"] > 4
    assert len(answered_first) + len(booked_first) == len(updates)
    # Only updates once the last epoch is handed out (two tasks are planned ahead) book
    # first; the very last one tells the worker to stop.
    assert 1 <= len(booked_first) <= 3
    assert updates[-1][0] == "c_booked" and "task_params_reply" not in updates[-1]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    epochs = [e for e in map(json.loads, metrics) if e["event"] == "epoch"]
    assert [(e["epoch"], e["exactly_once"]) for e in epochs] == [(1, True), (2, True)]
