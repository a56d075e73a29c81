"""A sync round's workers get their next tasks before the round is booked, and the rounds
that may end training are booked first (their workers are told to stop instead)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common import stagetrace
from tests.support.runs import train


def test_replies_go_out_before_booking_except_where_training_may_end(
    small_hsi: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(stagetrace.ENV, str(tmp_path / "trace"))
    summary = train(small_hsi, tmp_path / "run", "hsi-cnn", epochs=2, workers=1)
    (trace,) = (tmp_path / "trace").glob("server-*.jsonl")
    marks = [json.loads(line) for line in trace.read_text().splitlines()]
    rounds: list[list[str]] = []  # per published update: its marks up to the next one
    for mark in marks:
        if mark["ev"] == "c_applied":
            rounds.append([])
        elif rounds and mark["ev"] in ("c_reply", "c_booked"):
            rounds[-1].append(mark["ev"] if mark["ev"] == "c_booked" else mark["type"])
    answered_first = [r for r in rounds if r[:2] == ["task_params_reply", "c_booked"]]
    booked_first = [r for r in rounds if r and r[0] == "c_booked"]
    assert len(rounds) == summary["steps"] > 4
    assert len(answered_first) + len(booked_first) == len(rounds)
    # Only rounds once the last epoch is handed out (two are planned ahead) book first;
    # the very last one tells the worker to stop.
    assert 1 <= len(booked_first) <= 3
    assert rounds[-1][0] == "c_booked" and "task_params_reply" not in rounds[-1]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    epochs = [e for e in map(json.loads, metrics) if e["event"] == "epoch"]
    assert [(e["epoch"], e["exactly_once"]) for e in epochs] == [(1, True), (2, True)]
