"""The run-folder rule: what a failed start leaves is no run; an applied update is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common import rundir
from common.errors import ConfigError


def test_a_failed_start_is_no_run_and_an_update_is(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"event": "start"}\n{"event": "join"}\n')
    (tmp_path / "summary.json").write_text('{"steps": 0, "final": null}')
    (tmp_path / "tensorboard").mkdir()
    assert not rundir.started(tmp_path)
    rundir.check(tmp_path, resume=False, overwrite=False)
    assert rundir.clear(tmp_path) == ["metrics.jsonl", "summary.json"]
    (tmp_path / "metrics.jsonl").write_text('{"event": "start"}\n{"event": "push"}\n')
    assert rundir.started(tmp_path)
    with pytest.raises(ConfigError, match=r"already holds a run .*--resume .*--overwrite"):
        rundir.check(tmp_path, resume=False, overwrite=False)
    rundir.check(tmp_path, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="exclude each other"):
        rundir.check(tmp_path, resume=True, overwrite=True)


@pytest.mark.parametrize(
    "held",
    ["checkpoints/ckpt-0000000003.npz", "snapshots/snap-0000000003.npz", "summary.json"],
)
def test_checkpoints_snapshots_and_a_summary_with_updates_hold_a_run(
    tmp_path: Path, held: str
) -> None:
    path = tmp_path / held
    path.parent.mkdir(exist_ok=True)
    path.write_text('{"steps": 3}')
    assert rundir.started(tmp_path)


def test_a_fifo_at_the_metrics_name_is_never_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "metrics.jsonl")
    assert not rundir.started(tmp_path)  # returns at once: opening a FIFO would block
