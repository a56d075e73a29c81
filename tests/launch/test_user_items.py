"""What a new user meets on the way: worker counts, typos in addresses, folders, help, legends."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.errors import ConfigError
from common.training.tables import summary_tables
from launch.cli import main as pslaunch_main
from launch.cli_options import build_workers
from launch.progress import RunProgress
from pserver.cli import main as pserver_main
from tests.support.live import live_server
from worker.cli import main as worker_main
from worker.config import check_server_host


def test_workers_default_to_one_per_device() -> None:
    factors, _, devices = build_workers(None, "1", "", "cpu,cpu,cuda:0")
    assert factors == (1.0, 1.0, 1.0) and devices == ("cpu", "cpu", "cuda:0")
    factors, _, _ = build_workers(None, "1,2", "", "cpu")
    assert factors == (1.0, 2.0)
    factors, _, _ = build_workers(4, "1", "", "cpu")
    assert factors == (1.0,) * 4


def test_an_unknown_server_host_fails_at_once() -> None:
    with pytest.raises(ConfigError, match=r"'no-such-host\.invalid' cannot be resolved"):
        check_server_host("tcp://no-such-host.invalid:5555")
    check_server_host("tcp://127.0.0.1:5555")
    check_server_host("tcp://localhost:5555")
    check_server_host("ipc:///tmp/x")
    begin = time.monotonic()
    res = CliRunner().invoke(
        worker_main,
        ["join", "--server", "tcp://no-such-host.invalid:5555", "--connect-timeout", "30"],
    )
    assert res.exit_code == 1 and "cannot be resolved" in res.output, res.output
    assert time.monotonic() - begin < 15  # not the 30 s connect timeout


def test_export_of_a_comparison_folder_names_its_runs(tmp_path: Path) -> None:
    (tmp_path / "compare.json").write_text(json.dumps({"settings": {}, "runs": []}))
    for name in ("async-1", "weighted-sync-1"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    res = CliRunner().invoke(pserver_main, ["export", str(tmp_path), "--out", "m.pt"])
    assert res.exit_code == 1
    assert "is a comparison folder" in res.output
    assert "runs/async-1, runs/weighted-sync-1" in res.output


def test_predicting_from_a_training_checkpoint_says_to_export_it(tmp_path: Path) -> None:
    import numpy as np

    from pserver.checkpoint import Checkpoint, write

    state = np.zeros(100, dtype=np.float32)
    ckpt = write(tmp_path / "checkpoints", Checkpoint({"state": state}, {"version": 7}))
    args = ["predict", "--model", str(ckpt), "--cube", str(tmp_path / "x.npy"), "--out", "m.png"]
    res = CliRunner().invoke(pserver_main, args)
    assert res.exit_code == 1, res.output
    assert res.output.strip().splitlines() == [
        f"Error: '{ckpt}' is a training checkpoint (or another .npz), not a model file: make one "
        "with 'pserver export RUN_DIR --out model.pt' (--checkpoint FILE exports this "
        "checkpoint), then predict with that"
    ]


@pytest.mark.parametrize(
    ("group", "args"),
    [
        (pserver_main, ["--help"]),
        (pserver_main, ["data", "--help"]),
        (pserver_main, ["data", "prepare", "--help"]),
        (pslaunch_main, ["--help"]),
        (worker_main, ["--help"]),
    ],
)
def test_help_lists_commands_without_cutting_their_summaries(group, args) -> None:
    res = CliRunner().invoke(group, args)
    assert res.exit_code == 0
    commands = res.output.split("Commands:", 1)[1]
    assert "..." not in commands, commands


def test_async_worker_table_says_why_a_slow_worker_can_read_faster() -> None:
    workers = [
        {"name": "w0-x2", "slowdown": 2.0, "speed": 900.0, "samples": 600, "pushes": 30},
        {"name": "w1-x4", "slowdown": 4.0, "speed": 1100.0, "samples": 300, "pushes": 15},
    ]
    summary = {"mode": "async", "epochs": 1, "steps": 45, "train_time_s": 1.0,
               "final": {}, "workers": workers}  # fmt: skip
    text = " ".join(summary_tables(summary).split())
    assert "its speed can read higher than a faster worker's" in text
    assert "can read higher" not in " ".join(
        summary_tables({**summary, "mode": "equal-sync"}).split()
    )


def test_the_progress_rate_starts_at_the_first_update() -> None:
    bar = RunProgress(epochs=2, max_steps=None, file=io.StringIO())
    bar.feed({"event": "start", "train": 100})
    before = time.time()
    bar.feed({"event": "round", "epoch": 1, "version": 1, "workers": [{"batch": 64}]})
    assert bar.bar.start_t >= before  # start-up before the first update is not in the rate
    assert bar.bar.n == 64 and bar.bar.total == 200
    bar.close()


async def test_a_stop_before_any_update_writes_no_checkpoint_and_no_evaluation(
    small_hsi: Path, tmp_path: Path
) -> None:
    async with live_server(
        small_hsi, mode="weighted-sync", workers=2, run_dir=tmp_path / "run"
    ) as ps:
        assert ps.updater.version == 0  # nobody joined: the stop comes before round 1
    assert not [e for e in ps.log.events if e["event"] == "eval"]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final"] is None and summary["steps"] == 0


async def test_requests_refused_while_a_run_ends_are_no_warnings(
    small_hsi: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from common.errors import ErrorCode
    from common.protocol.messages import JoinRequest
    from tests.support.live import clients

    caplog.set_level(logging.DEBUG, logger="pserver")
    async with (
        live_server(small_hsi, mode="async", workers=1, shutdown_timeout_s=5.0) as ps,
        clients(ps.address, 2) as (first, late),
    ):  # fmt: skip
        await first.join("w0")
        ps.request_stop()  # what Ctrl-C does
        error = await late.expect_error(
            JoinRequest(name="late", device="cpu", slowdown=1.0, threads=1)
        )
        assert error.code == ErrorCode.SHUTTING_DOWN
    refused = [r for r in caplog.records if "SHUTTING_DOWN" in r.getMessage()]
    assert refused and all(r.levelno == logging.DEBUG for r in refused)


async def test_stop_and_heartbeat_replies_say_why_training_ended(
    small_hsi: Path, tmp_path: Path
) -> None:
    from common.errors import ErrorCode, ProtocolError
    from common.protocol.ending import FinishReason
    from common.protocol.messages import (
        REPLIES,
        HeartbeatReply,
        HeartbeatRequest,
        JoinRequest,
        TaskRequest,
        parse_message,
    )
    from common.protocol.wire import encode_frames
    from pserver.runstate import RunState
    from tests.support.live import clients

    async with (
        live_server(small_hsi, mode="async", workers=2, epochs=50, run_dir=tmp_path / "run") as ps,
        clients(ps.address, 1) as (reader,),
    ):  # fmt: skip
        joined = await reader.request(
            JoinRequest(name="new", device="cpu", slowdown=1.0, threads=1, host="node-7")
        )
        ids = {"worker_id": joined.worker_id, "token": joined.token}
        beat = await reader.request(HeartbeatRequest(**ids))
        assert beat.finish_reason is None
        ps.request_stop()  # what Ctrl-C and SIGTERM do
        beat = await reader.request(HeartbeatRequest(**ids))
        assert (beat.finish_reason, beat.failure) == (FinishReason.STOPPED, None)
        stop = await reader.request(TaskRequest(**ids, speed=100.0))
        assert (stop.action, stop.failure) == ("stop", None)
        assert stop.finish_reason is FinishReason.STOPPED
    hosts = [(e["worker"], e["host"]) for e in ps.log.events if e["event"] == "join"]
    assert hosts == [("new", "node-7")]
    failed = RunState(reason=FinishReason.FAILED, error="shard 1 lost")
    assert failed.finish_reason == "failed: shard 1 lost" and failed.failed == "shard 1 lost"
    assert all(reason.words for reason in FinishReason)  # a worker's last line for each
    # a reason outside the list is refused on the wire, not shown
    body = {"server_id": "s", "finish_reason": "exploded"}
    frames = encode_frames({"type": HeartbeatReply.TYPE, "id": 1, "status": "ok", "body": body})
    with pytest.raises(ProtocolError) as refused:
        parse_message([bytes(f) for f in frames], REPLIES)
    assert refused.value.code == ErrorCode.BAD_FIELD and "finish_reason" in str(refused.value)


@pytest.mark.parametrize(
    "args",
    [["export", "."], ["predict", "--model", "m.pt", "--cube", "c.mat"]],
    ids=["export", "predict"],
)
def test_a_missing_output_file_is_a_usage_error_before_any_work(args: list[str]) -> None:
    result = CliRunner().invoke(pserver_main, args)
    assert result.exit_code == 2 and "Missing option '--out'" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["predict", "--model", "m.pt", "--cube", "c.mat", "--out", "NOWHERE/map.png"],
        ["predict", "--model", "m.pt", "--cube", "c", "--out", "m.png", "--npy", "NOWHERE/m.npy"],
        ["export", ".", "--out", "NOWHERE/m.pt"],
        ["data", "prepare", "hsi", "--cube", "c.mat", "--gt", "g.mat", "--out", "NOWHERE/d.h5"],
        ["data", "synth", "--kind", "hsi", "--out", "NOWHERE/d.h5"],
    ],
    ids=["predict", "predict-npy", "export", "prepare", "synth"],
)  # fmt: skip
def test_an_output_folder_that_does_not_exist_is_refused_before_any_work(
    args: list[str], tmp_path: Path
) -> None:
    args = [a.replace("NOWHERE", str(tmp_path / "missing")) for a in args]
    result = CliRunner().invoke(pserver_main, args)
    assert result.exit_code == 2
    assert f"the folder {str(tmp_path / 'missing')!r} does not exist" in result.output
