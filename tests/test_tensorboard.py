"""TensorBoard event files: written from run-log events, read back with EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.training.runlog import RunLog
from common.training.tbsink import SUBDIR


def scalars(run_dir: Path) -> dict[str, list]:
    """Every scalar series under the run's TensorBoard folder, read by TensorBoard itself."""
    acc = EventAccumulator(str(run_dir / SUBDIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def _eval(log: RunLog, samples: int, oa: float) -> None:
    log.event(
        "eval", version=samples // 10, epoch=1, samples=samples, oa=oa, aa=oa, kappa=oa, loss=1 - oa
    )


def test_run_log_writes_scalars_for_every_event_kind(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    for samples, oa in ((100, 0.5), (200, 0.75), (300, 0.875)):
        _eval(log, samples, oa)
    for version in (1, 2):
        log.event(
            "round",
            round=version,
            version=version,
            round_s=0.5,
            workers=[
                {"worker": "fast/gpu", "batch": 30, "speed": 120.0},
                {"worker": "slow", "batch": 10, "speed": 20.0},
            ],
        )
    log.event("push", worker="slow", batch=8, speed=3.0, staleness=2, version=3)
    log.event("push", worker="fast/gpu", batch=24, speed=9.0, staleness=0, version=4)
    log.event("join", worker="ignored")
    log.close()
    series = scalars(tmp_path)
    oa = series["eval/oa"]
    assert [s.step for s in oa] == [100, 200, 300]
    assert [s.value for s in oa] == [0.5, 0.75, 0.875]
    assert [s.value for s in series["eval/loss"]] == pytest.approx([0.5, 0.25, 0.125])
    assert [s.value for s in series["round/seconds"]] == [0.5, 0.5]
    # fast: 30/120 = 0.25 s compute of 0.5; slow: 0.5 of 0.5 -> mean idle share 0.25
    assert series["round/idle_share"][0].value == pytest.approx(0.25)
    assert series["worker/fast_gpu/batch_share"][0].value == 0.75  # '/' made tag-safe
    assert series["worker/fast_gpu/idle_share"][0].value == pytest.approx(0.5)
    assert [s.value for s in series["push/staleness"]] == [2, 0]
    assert series["worker/slow/staleness"][0].value == 2
    assert series["worker/fast_gpu/batch_share"][-1].value == pytest.approx(24 / 32)
    assert series["worker/slow/speed"][-1].value == 3.0


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
