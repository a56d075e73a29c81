"""Failures with real processes: a worker killed mid-round (which changes no update), late
joins, graceful leaves, a frozen worker dropped and joining again, a killed server resumed by hand
or restarted by the launcher."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from common.polling import poll_until
from common.procs import Child
from pserver.checkpoint import read_newest
from pserver.history import check_history, read_history
from tests.support.cluster import events, start_server, start_worker, summary
from tests.support.launches import MARK, processes_marked, start_pslaunch

TRAIN = ("--lr", "0.05", "--lr-schedule", "cosine")
RUN_WAIT_S = 240.0


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch) -> str:
    """A unique value every process this test starts carries in its environment."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARK, value)
    return value


@pytest.mark.exclusive  # asserts when the death was detected
def test_kill_9_of_a_worker_mid_round_in_weighted_sync(jasper_h5: Path, tmp_path: Path) -> None:
    server, address = start_server(
        jasper_h5,
        tmp_path,
        "--mode",
        "weighted-sync",
        "--workers",
        "3",
        "--epochs",
        "8",
        "--dead-after",
        "3",
        *TRAIN,
    )
    workers = [start_worker(address, f"w{s}", s) for s in (1, 2, 4)]
    try:
        server.wait_for("epoch 2 done")
        victim = workers[1]
        victim.popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        server.wait_for("is gone: dead")
        detected_after = time.monotonic() - killed_at
        assert server.wait() == 0
        assert [w.wait() for w in (workers[0], workers[2])] == [0, 0]
    finally:
        for proc in (server, *workers):
            proc.kill()
    print(f"dead worker detected after {detected_after:.2f} s (--dead-after 3)")
    # The deadline runs from the worker's last message, which may precede the kill by up to
    # the round it was waiting on; a declaration a second or more early would still show.
    assert 2.0 <= detected_after <= 10
    records = events(tmp_path)
    gone = [e for e in records if e["event"] == "leave" and e["reason"].startswith("dead")]
    assert [e["worker"] for e in gone] == ["w2"]
    epochs = [e for e in records if e["event"] == "epoch"]
    assert len(epochs) == 8 and all(e["exactly_once"] and e["samples"] == 964 for e in epochs)
    result = summary(tmp_path)
    assert result["samples_seen"] == 8 * 964
    assert result["final"]["oa"] >= 0.85


# Enough epochs of the small dataset (9 rounds each) that b is still training when the test,
# reading the server's log, interrupts it: 100 were done within that delay on a quiet machine.
# The test stops the server once two epochs ended after b left.
EPOCHS = 400


@pytest.mark.exclusive  # interrupts a worker before the run ends
def test_late_joiner_is_used_and_a_leaver_is_not_waited_for(
    small_hsi: Path, tmp_path: Path
) -> None:
    server, address = start_server(
        small_hsi,
        tmp_path,
        "--mode",
        "weighted-sync",
        "--workers",
        "2",
        "--epochs",
        str(EPOCHS),
        "--global-batch",
        "16",
        *TRAIN,
    )
    first = [start_worker(address, "a", 1), start_worker(address, "b", 2)]
    late = None
    try:
        server.wait_for("epoch 2 done")
        late = start_worker(address, "late", 1)
        server.wait_for("worker late joined")
        server.wait_for(" done at version")  # an epoch ends with the late worker in the rounds
        server.wait_for(" done at version")
        assert first[1].popen.poll() is None, "the run ended before b could be interrupted"
        masks = _signal_masks(first[1].popen.pid)
        first[1].popen.send_signal(signal.SIGINT)  # Ctrl-C: a graceful leave
        assert first[1].wait() != 0, (masks, list(first[1].lines)[-5:])
        server.wait_for("is gone: left: interrupted")
        server.wait_for(" done at version")  # epochs end without b: it is not waited for
        server.wait_for(" done at version")
        server.popen.send_signal(signal.SIGINT)  # Ctrl-C: the rest of the run shows nothing more
        assert server.wait() == 128 + signal.SIGINT
        assert first[0].wait() == 0 and late.wait() == 0
    finally:
        for proc in (server, *first, *([late] if late else [])):
            proc.kill()
    result = summary(tmp_path)
    assert result["finish_reason"] == "stopped"
    by_name = {w["name"]: w for w in result["workers"]}
    assert by_name["late"]["samples"] > 0 and by_name["late"]["pushes"] > 0
    records = events(tmp_path)
    left = next(i for i, e in enumerate(records) if e["event"] == "leave" and e["worker"] == "b")
    epochs = [e for e in records if e["event"] == "epoch"]
    assert all(e["exactly_once"] for e in epochs)
    assert sum(e["event"] == "epoch" for e in records[left:]) >= 2
    rounds = [e for e in records if e["event"] == "round"]
    after_leave = rounds[-3:]  # b is not waited for; on steps this small the model planner
    # may leave a or late out of a round (one sample would outlast it), never add b
    assert all({w["worker"] for w in r["workers"]} <= {"a", "late"} for r in after_leave)
    assert any(w["worker"] == "late" for r in rounds for w in r["workers"])


@pytest.mark.exclusive  # --dead-after 2 against compute time
def test_kill_9_of_the_server_then_resume_with_the_same_workers(
    jasper_h5: Path, tmp_path: Path
) -> None:
    args = (
        "--mode",
        "async",
        "--workers",
        "2",
        "--epochs",
        "8",
        "--checkpoint-every",
        "40",
        "--dead-after",
        "2",
        "--heartbeat",
        "0.5",
        *TRAIN,
    )
    server, address = start_server(jasper_h5, tmp_path, *args)
    workers = [start_worker(address, f"w{s}", s) for s in (1, 2)]
    restarted = None
    try:
        line = server.wait_for("checkpoint of version")
        saved = int(line.split("checkpoint of version", 1)[1].split()[0])
        server.wait_for("epoch 2 done")  # train on past the checkpoint, then crash
        server.popen.send_signal(signal.SIGKILL)
        server.wait()
        restarted, again = start_server(jasper_h5, tmp_path, *args, "--resume", bind=address)
        assert again == address
        line = restarted.expect("resumed at version")
        resumed = int(line.split("resumed at version", 1)[1].split()[0])
        assert resumed >= saved
        for name in ("w1", "w2"):
            restarted.expect(f"worker {name} joined")
        assert restarted.wait() == 0
        assert [w.wait() for w in workers] == [0, 0]
    finally:
        for proc in (server, *workers, *([restarted] if restarted else [])):
            proc.kill()
    records = events(tmp_path)
    resume = next(e for e in records if e["event"] == "resume")
    assert resume["version"] == resumed
    epochs = [e for e in records if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs][-1] == 8
    assert all(e["exactly_once"] and e["samples"] == 964 for e in epochs)
    result = summary(tmp_path)
    assert result["epochs"] == 8 and result["final"]["oa"] >= 0.8
    assert {w["name"] for w in result["workers"]} == {"w1", "w2"}


@pytest.mark.exclusive  # asserts how long the stop took
def test_sigterm_stops_the_round_checkpoints_and_workers_exit_0_server_non_zero(
    small_hsi: Path, tmp_path: Path
) -> None:
    server, address = start_server(
        small_hsi,
        tmp_path,
        "--mode",
        "equal-sync",
        "--workers",
        "2",
        "--epochs",
        "1000",
        "--shutdown-timeout",
        "10",
    )
    workers = [start_worker(address, "a", 1), start_worker(address, "b", 3)]
    try:
        server.wait_for("epoch 2 done")
        server.popen.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        assert server.wait(timeout=30) == 128 + signal.SIGTERM  # interrupted: non-zero, says so
        took = time.monotonic() - stopped_at
        server.expect("interrupted; checkpoint and summary written")
        assert [w.wait(timeout=30) for w in workers] == [0, 0]
    finally:
        for proc in (server, *workers):
            proc.kill()
    assert took < 10
    result = summary(tmp_path)
    assert result["finish_reason"] == "stopped"
    saved = [e for e in events(tmp_path) if e["event"] == "checkpoint"]
    assert saved and saved[-1]["version"] == result["steps"]
    assert (tmp_path / "checkpoints").is_dir()


def test_a_worker_with_a_mismatched_local_copy_is_refused(small_hsi: Path, tmp_path: Path) -> None:
    from common.data.convert.synth import synth_hsi

    other = tmp_path / "other.h5"
    synth_hsi(other, bands=16, size=24, classes=4, train_fraction=0.3, seed=2)  # other data
    server, address = start_server(
        small_hsi, tmp_path / "run", "--epochs", "1", "--shutdown-timeout", "1"
    )
    worker = start_worker(address, "wrong-copy", 1.0, "--data", str(other))
    try:
        assert worker.wait() != 0
        line = worker.expect("fingerprint")
        assert str(other) in line and "the server's dataset has" in line
        server.expect("is gone: left: failed: DatasetError: local copy")
    finally:
        server.popen.send_signal(signal.SIGTERM)
        server.wait()
        worker.kill()
        server.kill()


def _signal_masks(pid: int) -> dict[str, str]:
    """The signal masks of a process (Linux /proc): blocked, ignored, caught."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in status) if k in
            ("SigBlk", "SigIgn", "SigCgt")}  # fmt: skip


# --- restarts by the launcher and deaths that change nothing ----------------------------------


def _wait_for(run_dir: Path, found: Callable[[list[dict]], Any], launcher: Child, what: str) -> Any:
    """Poll the run's history until ``found`` returns something; fail if the launcher ends."""

    def look() -> Any:
        if launcher.code is not None:
            raise AssertionError(f"the launch ended first: {launcher.failure()}")
        path = run_dir / "metrics.jsonl"
        return found([e for _, e in read_history(path)]) if path.exists() else None

    return poll_until(look, RUN_WAIT_S, 0.2, what)


def _kill_child(launcher: Child, *words: str) -> None:
    """SIGKILL the launcher's first child whose command line holds ``words``."""
    for child in psutil.Process(launcher.pid).children():
        if set(words) <= set(child.cmdline()):
            child.send_signal(signal.SIGKILL)
            return
    raise AssertionError(f"the launcher runs no {' '.join(words)}")


def _past_a_checkpoint(events: list[dict]) -> dict | None:
    """The newest checkpoint event once 3 updates past it are recorded (they will be made
    again after a restart), else None."""
    saved = [e for e in events if e["event"] == "checkpoint"]
    made = [e["version"] for e in events if e["event"] == "round"]
    return saved[-1] if saved and made and made[-1] >= saved[-1]["version"] + 3 else None


def _launch(small_hsi: Path, run_dir: Path, restarts: int) -> Child:
    return start_pslaunch(
        *("local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--mode", "weighted-sync"),
        *("--slowdowns", "1,2", "--epochs", "60", "--global-batch", "16", "--lr", "0.05"),
        *("--run-dir", str(run_dir), "--no-progress", "--restarts", str(restarts)),
        "--server-opt=--dead-after=2",
        "--server-opt=--heartbeat=0.5",
        # Checkpoints rare enough (an epoch is 9 updates) that the kills land before the next.
        "--server-opt=--checkpoint-every=60",
    )


@pytest.mark.exclusive  # --dead-after 2 against compute time
def test_a_killed_server_is_restarted_by_pslaunch_and_the_run_goes_on(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    run_dir = tmp_path / "run"
    launcher = _launch(small_hsi, run_dir, restarts=1)
    try:
        saved = _wait_for(run_dir, _past_a_checkpoint, launcher, "3 updates past a checkpoint")
        _kill_child(launcher, "worker.cli", "join")
        _kill_child(launcher, "pserver.cli", "start")
        assert launcher.wait(RUN_WAIT_S) == 0, launcher.tail()
    finally:
        launcher.kill()
    assert processes_marked(mark) == []
    result = summary(run_dir)
    assert result["restarts"] == 1 and result["finish_reason"] == "epochs"
    assert result["worker_restarts"] == 1  # the worker killed
    assert result["versions_replayed"] >= 3 and result["epochs"] == 60
    records = read_history(run_dir / "metrics.jsonl")
    resume = next(e for _, e in records if e["event"] == "resume")
    assert resume["version"] >= saved["version"] and resume["samples"] > 0
    assert check_history(records) == []  # every epoch exactly once, one update per version
    epochs = [e for _, e in records if e["event"] == "epoch" and e["version"] > resume["version"]]
    assert epochs and epochs[-1]["epoch"] == 60


def test_with_restarts_0_a_killed_server_fails_the_launch_and_nothing_is_left(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    run_dir = tmp_path / "run"
    launcher = _launch(small_hsi, run_dir, restarts=0)
    try:
        _wait_for(
            run_dir,
            lambda es: any(e["event"] == "round" for e in es),
            launcher,
            "training",
        )
        _kill_child(launcher, "pserver.cli", "start")
        assert launcher.wait(RUN_WAIT_S) == 1
    finally:
        launcher.kill()
    error = launcher.output()
    assert "server was killed by SIGKILL (signal 9)" in error
    assert "no restart left (--restarts 0)" in error
    assert processes_marked(mark) == []


@pytest.mark.exclusive  # --dead-after 2 against compute time
def test_a_worker_killed_mid_round_changes_no_update(small_hsi: Path, tmp_path: Path) -> None:
    """GroupNorm, weighted-sync, the same seed: one run without faults, one whose worker c is
    killed -9 once it computed its 6th task, before pushing it; its samples in the rounds it
    was planned in are planned again among a and b, so every update is the same and so are the
    final parameters."""
    options = (
        *("--model", "hsi-cnn-gn", "--mode", "weighted-sync", "--workers", "3"),
        *("--epochs", "3", "--global-batch", "16", "--lr", "0.05", "--seed", "3"),
        *("--dead-after", "2", "--heartbeat", "0.5"),
        # Shares in proportion to speed: c takes part in every round however much its round
        # times scatter (the model planner may sit it out until the run has ended).
        *("--planner", "speed"),
    )
    states = []
    for faulted in (False, True):
        run_dir = tmp_path / ("faulted" if faulted else "steady")
        server, address = start_server(small_hsi, run_dir, *options)
        workers = [start_worker(address, n, 1.0, "--log-every", "1") for n in "abc"]
        try:
            if faulted:
                workers[2].wait_for("step 6 ")  # computed, about to push
                workers[2].popen.send_signal(signal.SIGKILL)
                server.wait_for("worker c is gone: dead")
            assert server.wait() == 0
            assert [w.wait() for w in workers[:2]] == [0, 0]
        finally:
            for proc in (server, *workers):
                proc.kill()
        records = read_history(run_dir / "metrics.jsonl")
        assert check_history(records) == []
        rounds = [e for _, e in records if e["event"] == "round"]
        states.append((read_newest(run_dir / "checkpoints"), rounds))
    (steady, steady_rounds), (faulted_ckpt, faulted_rounds) = states
    assert faulted_ckpt.version == steady.version == len(steady_rounds) == len(faulted_rounds)
    assert [sum(w["batch"] for w in r["workers"]) for r in faulted_rounds] == [
        sum(w["batch"] for w in r["workers"]) for r in steady_rounds
    ]
    assert any("c" not in {w["worker"] for w in r["workers"]} for r in faulted_rounds)
    gap = np.abs(faulted_ckpt.arrays["state"] - steady.arrays["state"]).max()
    assert gap <= 1e-5, f"max |difference| {gap:.3g}"


@pytest.mark.exclusive  # --dead-after 2 against compute time
def test_a_frozen_worker_is_dropped_and_joins_again_when_it_thaws(
    small_hsi: Path, tmp_path: Path
) -> None:
    server, address = start_server(
        small_hsi, tmp_path, "--epochs", str(EPOCHS), "--global-batch", "16", "--dead-after", "2"
    )
    steady, frozen = start_worker(address, "steady"), start_worker(address, "frozen")
    try:
        server.wait_for("worker frozen joined")
        server.wait_for(" done at version")
        frozen.popen.send_signal(signal.SIGSTOP)  # stopped mid-run, as a preempted job is
        server.wait_for("worker frozen is gone: dead")
        frozen.popen.send_signal(signal.SIGCONT)
        server.wait_for("worker frozen joined")
        server.wait_for(" done at version")  # epochs go on with the thawed worker back in
        server.wait_for(" done at version")
        server.popen.send_signal(signal.SIGINT)
        assert server.wait() == 128 + signal.SIGINT
        assert [steady.wait(), frozen.wait()] == [0, 0], frozen.tail()
    finally:
        for proc in (server, steady, frozen):
            proc.popen.send_signal(signal.SIGCONT)
            proc.kill()
    records = events(tmp_path)
    assert [e["worker"] for e in records if e["event"] == "join"].count("frozen") == 2
    assert all(e["exactly_once"] for e in records if e["event"] == "epoch")
    assert summary(tmp_path)["finish_reason"] == "stopped"
