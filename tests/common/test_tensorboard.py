"""TensorBoard event files: written from run-log events, read back with EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.training.runlog import RunLog
from common.training.tbsink import SUBDIR
from tests.support.tensorboard import scalars


def _eval(log: RunLog, samples: int, oa: float) -> None:
    log.event(
        "eval", version=samples // 10, epoch=1, samples=samples, oa=oa, aa=oa, kappa=oa, loss=1 - oa
    )


def _round(log: RunLog, t: float, version: int, round_s: float) -> None:
    log.event(
        "round",
        t=t,
        round=version,
        version=version,
        round_s=round_s,
        workers=[
            {"worker": "fast/gpu", "batch": 30, "speed": 120.0 + version},
            {"worker": "slow", "batch": 10, "speed": 20.0},
        ],
    )


def test_run_log_writes_scalars_for_every_event_kind(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    for samples, oa in ((100, 0.5), (200, 0.75), (300, 0.875)):
        _eval(log, samples, oa)
    _round(log, 10.0, 1, 0.5)  # these two share one record (within INTERVAL_S)
    _round(log, 10.1, 2, 1.0)
    _round(log, 11.0, 3, 0.5)  # a new record
    log.event("push", t=20.0, worker="slow", batch=8, speed=3.0, staleness=2, version=4)
    log.event("push", t=20.2, worker="fast/gpu", batch=24, speed=9.0, staleness=0, version=5)
    log.event("join", worker="ignored")
    log.close()
    series = scalars(tmp_path)
    oa = series["eval/oa"]
    assert [s.step for s in oa] == [100, 200, 300]
    assert [s.value for s in oa] == [0.5, 0.75, 0.875]
    assert [s.value for s in series["eval/loss"]] == pytest.approx([0.5, 0.25, 0.125])
    assert [(s.step, s.value) for s in series["round/count"]] == [(2, 2), (3, 1)]
    assert [s.value for s in series["round/seconds"]] == pytest.approx([0.75, 0.5])
    # round 1: fast computes 30/121 s of 0.5, slow 0.5 of 0.5 (busy): idle share (1-60/121)/2
    # round 2: fast 30/122 of 1.0, slow 0.5 of 1.0
    first = ((1 - 60 / 121) / 2 + (1 - 30 / 122 + 0.5) / 2) / 2
    assert series["round/idle_share"][0].value == pytest.approx(first)
    assert series["worker/fast_gpu/batch_share"][0].value == 0.75  # '/' made tag-safe
    assert series["worker/fast_gpu/speed"][0].value == 122.0  # the last in the record
    assert series["worker/slow/idle_share"][0].value == pytest.approx(0.25)  # mean of 0, 0.5
    (push,) = series["push/count"]
    assert (push.step, push.value) == (5, 2)
    assert series["push/staleness"][0].value == 1.0 and series["push/staleness_max"][0].value == 2
    assert series["worker/slow/staleness"][0].value == 2
    assert series["worker/fast_gpu/batch_share"][-1].value == pytest.approx(24 / 32)
    assert series["worker/slow/batch_share"][-1].value == pytest.approx(8 / 32)
    assert series["worker/slow/speed"][-1].value == 3.0
    # wall times follow the run clock: the push record at t = 20.2, the first rounds' at 10.1
    assert push.wall_time - series["round/count"][0].wall_time == pytest.approx(10.1, abs=1e-3)


def test_new_run_replaces_event_files_and_resume_appends(tmp_path: Path) -> None:
    first = RunLog(tmp_path)
    _eval(first, 100, 0.5)
    first.close()
    second = RunLog(tmp_path)  # a new run in the same directory starts a fresh board
    _eval(second, 100, 0.6)
    second.close()
    assert [s.value for s in scalars(tmp_path)["eval/oa"]] == pytest.approx([0.6])
    resumed = RunLog(tmp_path, resume_at=5.0)
    _eval(resumed, 200, 0.7)
    resumed.close()
    assert [s.value for s in scalars(tmp_path)["eval/oa"]] == pytest.approx([0.6, 0.7])
    assert len(list((tmp_path / SUBDIR).glob("events.out.tfevents.*"))) == 2


def test_no_run_dir_or_opt_out_writes_nothing(tmp_path: Path) -> None:
    RunLog(None).close()
    quiet = RunLog(tmp_path, tensorboard=False)
    _eval(quiet, 100, 0.5)
    quiet.close()
    assert not (tmp_path / SUBDIR).exists()
