"""Stage marks: written only when asked for, and cut into a round's critical path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.multihost.stages import STAGES, rounds
from common import stagetrace
from tests.support.paths import ROOT

MARKER = (
    "from common import stagetrace; stagetrace.start('worker'); stagetrace.mark('w_task', task=7)"
)


def run_marker(env: dict[str, str]) -> None:
    root = str(ROOT)
    subprocess.run(
        [sys.executable, "-c", MARKER],
        env={**os.environ, "PYTHONPATH": root, **env},
        check=True,
        timeout=60,
    )


def test_marks_go_to_the_named_directory(tmp_path: Path) -> None:
    run_marker({stagetrace.ENV: str(tmp_path / "trace")})
    files = list((tmp_path / "trace").glob("worker-*.jsonl"))
    assert len(files) == 1
    (mark,) = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert mark["ev"] == "w_task" and mark["task"] == 7 and isinstance(mark["t"], float)


def test_no_marks_without_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != stagetrace.ENV}
    run_marker({**env, "HOME": str(tmp_path)})
    assert not list(tmp_path.rglob("*.jsonl"))


def test_a_round_is_cut_along_its_critical_path() -> None:
    """Three workers (one sits out the next round), two shards; times in seconds."""

    def w(ev: str, t: float, **f: int) -> dict:
        return {"ev": ev, "t": t, **f}

    worker = [
        w("w_task", 0.0, task=1, version=0),
        w("w_task", 0.0, task=2, version=0),
        w("w_compute", 0.0, task=1),
        w("w_compute", 0.1, task=2),
        w("w_computed", 1.0, task=1),
        w("w_computed", 1.2, task=2),  # compute ends at 1.2
        w("w_chunk_out", 0.9, task=2),
        w("w_push", 1.25, task=2),  # push tail 0.05
        w("w_reply", 1.9, task=1),
        w("w_reply", 2.0, task=2),
        w("w_params", 2.3, task=2, version=1),
        w("w_params", 2.2, task=1, version=1),
        # a third worker sits out the next round: its push is answered when that round ends
        w("w_task", 0.0, task=9, version=0),
        w("w_compute", 0.05, task=9),
        w("w_computed", 0.5, task=9),
        w("w_push", 0.5, task=9),
        w("w_reply", 5.0, task=9),
        w("w_params", 5.1, task=9, version=1),
        w("w_task", 2.3, task=3, version=1),
        w("w_compute", 2.4, task=3),  # next 0.1
    ]
    shard = [
        w("s_chunk_in", 1.3, task=2),
        w("s_chunk_staged", 1.32, task=1),
        w("s_chunk_staged", 1.35, task=2),
        w("s_staged_request", 1.28, task=2),  # asked before the last chunk: 0
        w("s_staged_request_done", 1.36, task=2),
        w("s_prepare_request", 1.4, version=0),
        w("s_prepare_request_done", 1.6, version=0),
        w("s_publish_request", 1.62, version=0),
        w("s_publish_request_done", 1.7, version=1),
    ]
    (stages,) = rounds({"worker": worker, "shard": shard}).values()
    expected = {
        "compute": 1.2,
        "push tail": 0.05,
        "wire in": 0.05,
        "stage": 0.05,
        "coord ask": 0.0,
        "staged": 0.01,
        "prepare ask": 0.04,
        "optimizer": 0.2,
        "publish ask": 0.02,
        "publish": 0.08,
        "task reply": 0.3,
        "wire out": 0.3,
        "next": 0.1,
    }
    assert set(expected) == set(STAGES)
    for stage, seconds in expected.items():
        assert abs(stages[stage] - seconds) < 1e-9, (stage, stages[stage])
    assert abs(stages["round"] - 2.4) < 1e-9
