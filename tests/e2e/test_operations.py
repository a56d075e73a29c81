"""What operators run into, with real processes: a full disk, run directories, resumes, signals,
bad addresses, untrusted models, NaN losses. Every failure ends with a one-line error and a
non-zero exit, never a hang or a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.rundir import RUN_FILES
from tests.support.cluster import (
    events,
    start_module,
    start_pserver,
    start_server,
    start_worker,
    summary,
)
from tests.support.paths import ROOT
from tests.support.requirements import missing

QUICK = ("--epochs", "3", "--global-batch", "16", "--shutdown-timeout", "20")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _one_line_error(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert text in result.stderr, result.stderr


@contextlib.contextmanager
def small_disk(path: Path, size_kb: int, config: pytest.Config) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` mounted at ``path`` (needs root), unmounted afterwards."""
    if os.geteuid() != 0:
        missing(config, "tmpfs", "mounting a small tmpfs needs root")
    path.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path, leave_kb: int) -> None:
    """Fill the disk up to ``leave_kb`` kB of free space."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    (disk / "filler").write_bytes(b"\0" * max(free - leave_kb * 1024, 0))


@pytest.mark.exclusive  # mounts a tmpfs
def test_a_full_disk_ends_the_run_with_a_clear_error_and_no_leftovers(
    small_hsi: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    with small_disk(tmp_path / "disk", 1024, pytestconfig) as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        _fill(disk, leave_kb=24)  # metrics fit for a while; no checkpoint (600 kB) ever fits
        server, address = start_server(
            small_hsi, run_dir, *QUICK, "--epochs", "6", "--checkpoint-every", "4"
        )
        worker = start_worker(address, "w")
        try:
            code = server.wait(timeout=120)
            assert worker.wait(timeout=60) == 0
        finally:
            server.kill()
            worker.kill()
        log = server.output()
        assert code != 0, log
        assert "checkpoint failed" in log and "training finished (epochs)" in log, log
        assert "Error: " in log and "Traceback" not in log, log
        leftovers = (
            list((run_dir / "checkpoints").glob("*.tmp"))
            if (run_dir / "checkpoints").exists()
            else []
        )
        assert leftovers == []


def test_fifos_and_links_at_temporary_names_neither_hang_nor_are_written_through(
    small_hsi: Path, tmp_path: Path
) -> None:
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    victim.write_text("keep")
    server, address = start_server(
        small_hsi,
        run_dir,
        *("--mode", "equal-sync", "--workers", "1", "--max-steps", "6", "--global-batch", "16"),
        *("--snapshot-every-updates", "3", "--eval-every", "0", "--shutdown-timeout", "20"),
    )
    (run_dir / "checkpoints").mkdir()
    os.mkfifo(run_dir / "checkpoints" / ".ckpt-0000000006.npz.tmp")
    os.mkfifo(run_dir / "snapshots" / ".snap-0000000003.npz.tmp")
    (run_dir / "snapshots" / ".snap-0000000006.npz.tmp").symlink_to(victim)
    (run_dir / ".summary.json.tmp").symlink_to(victim)
    worker = start_worker(address, "w")
    try:
        assert server.wait(timeout=90) == 0, server.tail(30)
        assert worker.wait(timeout=30) == 0
    finally:
        server.kill()
        worker.kill()
    assert victim.read_text() == "keep"
    assert summary(run_dir)["steps"] == 6
    assert (run_dir / "checkpoints" / "ckpt-0000000006.npz").stat().st_size > 0
    snaps = sorted(p.name for p in (run_dir / "snapshots").glob("snap-*.npz"))
    assert snaps == ["snap-0000000003.npz", "snap-0000000006.npz"]
    assert list(run_dir.rglob("*.tmp")) == []


STUCK_SUMMARY = """\
import threading

import common.training.runlog


def _stuck(*args, **kwargs):
    threading.Event().wait()


common.training.runlog.RunLog.write_summary = _stuck
"""


@pytest.mark.exclusive  # asserts how long the stop took
def test_sigterm_ends_a_server_whose_write_is_stuck(small_hsi: Path, tmp_path: Path) -> None:
    """The summary write never returns (a stalled file system, which cannot be made here: a
    ``sitecustomize`` makes it block forever); SIGTERM still ends the server within
    --shutdown-timeout, naming the abandoned write."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(STUCK_SUMMARY)
    run_dir = tmp_path / "run"
    args = ["--bind", "tcp://127.0.0.1:0", "--dataset", str(small_hsi), "--model", "hsi-cnn"]
    args += ["--run-dir", str(run_dir), "--shutdown-timeout", "8", "--epochs", "3"]
    env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}"}
    server, _ = start_pserver(args, run_dir, env)
    try:
        begin = time.monotonic()
        server.popen.send_signal(signal.SIGTERM)
        server.wait(timeout=40)
        took = time.monotonic() - begin
    finally:
        server.kill()
    err = server.output()
    assert server.popen.returncode != 0 and "Error: cannot write summary.json" in err, err
    assert took < 8 + 8, (took, err)  # the timeout, then the interpreter's exit on shared cores
    assert "abandoned a stuck write: summary.json did not finish" in err, err


@pytest.mark.exclusive  # mounts a tmpfs
def test_an_unwritable_metrics_log_does_not_stop_training(
    small_hsi: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    with small_disk(tmp_path / "disk", 512, pytestconfig) as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        _fill(disk, leave_kb=0)
        server = start_module(
            [
                *("pserver.cli", "start", "--bind", "tcp://127.0.0.1:0"),
                *("--dataset", str(small_hsi), "--model", "hsi-cnn", "--run-dir", str(run_dir)),
                *QUICK,
            ],
            "server",
        )
        # no start event can be written: the address comes from the log line users read
        address = server.wait_for("pserver listening on ").split("listening on", 1)[1].strip()
        worker = start_worker(address, "w")
        try:
            code = server.wait(timeout=120)
            assert worker.wait(timeout=60) == 0
        finally:
            server.kill()
            worker.kill()
        log = server.output()
        assert code != 0 and "training finished (epochs)" in log, log
        assert "cannot write" in log and "metrics.jsonl" in log, log


def test_a_run_dir_holding_a_run_is_refused_unless_overwrite(
    small_hsi: Path, tmp_path: Path
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"event": "round", "version": 1}\n')
    args = ("--dataset", str(small_hsi), "--model", "hsi-cnn", "--bind", "tcp://127.0.0.1:0")
    args += ("--epochs", "1", "--run-dir", str(tmp_path))
    _one_line_error(_run("pserver.cli", "start", *args), "already holds a run")
    server, address = start_pserver([*args, "--overwrite"], tmp_path)
    worker = start_worker(address, "w")
    try:
        assert server.wait() == 0 and worker.wait() == 0
    finally:
        server.kill()
        worker.kill()
    assert summary(tmp_path)["epochs"] == 1


def test_a_failed_start_leaves_the_run_dir_as_it_was(small_hsi: Path, tmp_path: Path) -> None:
    """A port in use, a wrong model name or a dataset that is not HDF5: each start fails with
    its error and writes nothing the corrected command would refuse; with ``--overwrite`` the
    earlier run is kept."""
    not_hdf5 = tmp_path / "cube.h5"
    not_hdf5.write_text("not an HDF5 file\n")
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        starts = {
            f"tcp://127.0.0.1:{port}": (small_hsi, "hsi-cnn"),
            "tcp://127.0.0.1:0": (small_hsi, "no-such-model"),
            "tcp://127.0.0.1:1": (not_hdf5, "hsi-cnn"),
        }
        for bind, (dataset, model) in starts.items():
            args = ("pserver.cli", "start", "--dataset", str(dataset), "--model", model)
            result = _run(*args, "--bind", bind, "--epochs", "1", "--run-dir", str(run_dir))
            _one_line_error(result, "Error: ")
            assert "already holds a run" not in result.stderr
            assert [n for n in RUN_FILES if (run_dir / n).exists()] == [], result.stderr
        run_dir.mkdir(exist_ok=True)
        (run_dir / "metrics.jsonl").write_text('{"event": "start"}\n')
        args = ("pserver.cli", "start", "--dataset", str(small_hsi), "--model", "hsi-cnn")
        args += ("--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(run_dir), "--overwrite")
        _one_line_error(_run(*args), "Error: ")
    assert (run_dir / "metrics.jsonl").read_text() == '{"event": "start"}\n'


def test_resume_checks_the_seed_falls_back_and_finishes_a_finished_run(
    small_hsi: Path, tmp_path: Path
) -> None:
    server, address = start_server(small_hsi, tmp_path, *QUICK, "--checkpoint-every", "3")
    worker = start_worker(address, "w")
    try:
        assert server.wait() == 0 and worker.wait() == 0
    finally:
        server.kill()
        worker.kill()
    steps = summary(tmp_path)["steps"]
    common = ("--dataset", str(small_hsi), "--model", "hsi-cnn", "--bind", "tcp://127.0.0.1:0")
    common += ("--run-dir", str(tmp_path), "--resume", *QUICK)
    _one_line_error(_run("pserver.cli", "start", *common, "--seed", "7"), "--seed was 0, now 7")
    finished = _run(
        "pserver.cli", "start", *common, "--json"
    )  # the run had ended: no waiting for workers
    assert finished.returncode == 0, finished.stderr
    assert "had already ended" in finished.stderr
    assert json.loads(finished.stdout)["finish_reason"] == "epochs"
    assert summary(tmp_path)["steps"] == steps
    checkpoints = sorted((tmp_path / "checkpoints").glob("ckpt-*.npz"))
    for newest in checkpoints[-2:]:  # truncated, as by a crash mid-copy
        newest.write_bytes(newest.read_bytes()[:1000])
    server, address = start_pserver(common, tmp_path)
    worker = start_worker(address, "w")
    try:
        assert server.wait() == 0 and worker.wait() == 0
    finally:
        server.kill()
        worker.kill()
    log = server.output()
    assert "trying the previous checkpoint" in log and "resumed at version" in log, log
    assert summary(tmp_path)["steps"] == steps and summary(tmp_path)["epochs"] == 3


@pytest.mark.exclusive  # asserts how long a refused join took
def test_one_line_errors_for_a_busy_port_and_bad_addresses(small_hsi: Path, tmp_path: Path) -> None:
    server, address = start_server(small_hsi, tmp_path / "a", "--epochs", "1")
    try:
        busy = _run(
            "pserver.cli", "start", "--bind", address, "--dataset", str(small_hsi),
            "--model", "hsi-cnn", "--epochs", "1",
        )  # fmt: skip
        _one_line_error(busy, f"cannot listen on {address}")
    finally:
        server.popen.send_signal(signal.SIGTERM)
        server.wait()
    _one_line_error(_run("pserver.cli", "status", "--server", "localhost:5555"), "tcp://HOST:PORT")
    _one_line_error(
        _run("pserver.cli", "status", "--server", "tcp://no such host:1", "--timeout", "1"),
        "no such host",
    )
    begin = time.monotonic()
    lonely = _run(
        "worker.cli", "join", "--server", "tcp://127.0.0.1:9", "--connect-timeout", "3",
        timeout=60,
    )  # fmt: skip
    _one_line_error(lonely, "was never reached within --connect-timeout 3 s")
    assert "connecting to tcp://127.0.0.1:9" in lonely.stderr
    assert time.monotonic() - begin < 30
    too_big = _run(
        "pserver.cli", "start", "--dataset", str(small_hsi), "--model", "hsi-cnn",
        "--epochs", "1", "--global-batch", "200000",
    )  # fmt: skip
    _one_line_error(too_big, "--global-batch must be <= 131072")


@pytest.mark.exclusive  # asserts how long the exit took
def test_a_second_ctrl_c_exits_at_once(small_hsi: Path, tmp_path: Path) -> None:
    server, address = start_server(
        small_hsi, tmp_path, "--epochs", "500", "--shutdown-timeout", "120", "--dead-after", "120"
    )
    worker = start_worker(address, "frozen")
    try:
        server.wait_for("epoch 1 done")
        worker.popen.send_signal(signal.SIGSTOP)  # a member that will not collect its stop
        server.popen.send_signal(signal.SIGINT)
        server.wait_for("training finished (stopped)")
        begin = time.monotonic()
        server.popen.send_signal(signal.SIGINT)  # do not wait for it: exit now
        assert server.wait(timeout=10) == 128 + signal.SIGINT
        assert time.monotonic() - begin < 10
    finally:
        server.kill()
        worker.popen.send_signal(signal.SIGCONT)
        worker.kill()


USER_MODULE = '''
"""Importing this module has a side effect the test can see."""
import pathlib
import torch
from torch import nn

pathlib.Path(__file__).with_name("IMPORTED").write_text("yes")


class Exploding(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        return self.head(x.mean(dim=(2, 3))) * float("nan")


def build(in_channels, num_classes, input_size):
    return Exploding(in_channels, num_classes)
'''


def test_untrusted_models_are_not_imported_and_nan_losses_end_in_a_clear_leave(
    small_hsi: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_side = tmp_path / "server_side"
    package = server_side / "evil_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(USER_MODULE)
    worker_side = tmp_path / "worker_side"
    (worker_side / "evil_pkg").mkdir(parents=True)
    (worker_side / "evil_pkg" / "__init__.py").write_text("")
    (worker_side / "evil_pkg" / "model.py").write_text(USER_MODULE)
    model = "evil_pkg.model:build"
    monkeypatch.setenv("PYTHONPATH", str(server_side))
    server, address = start_pserver(
        [
            "--bind", "tcp://127.0.0.1:0", "--dataset", str(small_hsi), "--model", model,
            "--epochs", "2", "--run-dir", str(tmp_path / "run"), "--shutdown-timeout", "5",
        ],
        tmp_path / "run",
    )  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", str(worker_side))
    try:
        refused = start_worker(address, "careful")
        assert refused.wait(timeout=60) != 0
        assert "--allow-model evil_pkg.model:build" in refused.output()
        assert not (worker_side / "evil_pkg" / "IMPORTED").exists()  # never imported
        trusting = start_worker(address, "trusting", 1.0, "--allow-model", model)
        assert trusting.wait(timeout=120) != 0
        out = trusting.output()
        assert "the loss stayed nan" in out and "Traceback" not in out, out
        server.wait_for("is gone: left: failed: NonFiniteLoss")
    finally:
        server.popen.send_signal(signal.SIGTERM)
        server.wait()
        server.kill()
    assert [e for e in events(tmp_path / "run") if e["event"] == "leave"]
