"""The run log: every event in metrics.jsonl, a bounded history in memory, files only once
opened."""

from __future__ import annotations

import json
from pathlib import Path

from common.training.runlog import RECENT_EVENTS, RunLog


def test_memory_holds_the_latest_events_and_the_file_all_of_them(tmp_path: Path) -> None:
    log = RunLog(tmp_path, tensorboard=False)
    total = 3 * RECENT_EVENTS
    for version in range(total):
        log.event("push", worker="w0", batch=8, staleness=1, version=version)
    log.close()
    assert len(log.events) == RECENT_EVENTS
    assert [e["version"] for e in log.events] == list(range(total - RECENT_EVENTS, total))
    lines = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["version"] for line in lines] == list(range(total))


def test_a_log_opened_later_writes_nothing_before_and_everything_after(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    log = RunLog(run_dir, open_now=False)
    log.event("http", url="http://127.0.0.1:1/")
    assert not run_dir.exists()
    log.open()
    log.event("start", address="tcp://127.0.0.1:2")
    log.close()
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["http", "start"]
    assert (run_dir / "tensorboard").is_dir()


def test_a_resumed_log_starts_a_new_line_after_one_cut_short(tmp_path: Path) -> None:
    """A server killed while it wrote leaves half a line; the resumed server's first event must
    not be glued to it (launchers wait for that ``start`` event)."""
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "t": 0}\n{"event": "rou')
    log = RunLog(tmp_path, resume_at=5.0, tensorboard=False)
    log.event("start", address="tcp://x")
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"event": "rou'
    assert json.loads(lines[2])["address"] == "tcp://x"


def test_non_finite_numbers_are_written_as_null_and_kept_in_memory(tmp_path: Path) -> None:
    log = RunLog(tmp_path, tensorboard=False)
    log.event("round", round=1, round_s=0.5, workers=[{"worker": "w0", "batch": 8}], pair=(1, 2))
    nan = float("nan")
    log.event("round", round=2, loss=nan, workers=[{"speed": float("inf")}], pair=(nan, 2.5))
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) | {"t": 0} for line in lines] == [
        {
            "event": "round",
            "t": 0,
            "round": 1,
            "round_s": 0.5,
            "workers": [{"worker": "w0", "batch": 8}],
            "pair": [1, 2],
        },
        {
            "event": "round",
            "t": 0,
            "round": 2,
            "loss": None,
            "workers": [{"speed": None}],
            "pair": [None, 2.5],
        },
    ]
    assert log.events[-1]["loss"] != log.events[-1]["loss"]  # memory keeps the NaN
