"""``pslaunch local`` watches its children: fails fast with their error, forwards signals, never
leaves orphans, and lets the server write its summary when stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from common.cli_env import child_environment
from common.errors import PSError
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.local import LocalCluster, run_local
from launch.settings import TrainSettings

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 120.0
MARK = "RS_PSERVER_TEST_MARK"  # not a PSLAUNCH_* name: launchers pass those on to no child


def _processes_marked(mark: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose environment holds ``MARK=mark``: the
    launcher's children inherit it, wherever they were reparented."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch) -> str:
    """A unique value every process this test starts carries in its environment."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARK, value)
    return value


def _cluster(dataset: Path, run_dir: Path, **changes: object) -> LocalCluster:
    settings: dict[str, object] = {
        "dataset": dataset,
        "model": "hsi-cnn",
        "mode": "weighted-sync",
        "slowdowns": (1.0,),
        "run_dir": run_dir,
        "server_options": ("--epochs", "2", "--shutdown-timeout", "30"),
        "startup_timeout_s": WAIT_S,
        "run_timeout_s": WAIT_S,
    }
    settings.update(changes)
    return LocalCluster(**settings)  # type: ignore[arg-type]


def test_a_server_that_cannot_start_fails_the_launch_with_its_error(
    tmp_path: Path, mark: str
) -> None:
    cluster = _cluster(tmp_path / "missing.h5", tmp_path / "run")
    with pytest.raises(PSError, match=r"did not start: server exited with code 2: .*not exist"):
        run_local(cluster)
    assert _processes_marked(mark) == []


def test_the_only_worker_failing_ends_the_run_with_its_error(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    """A worker asking for CUDA on a machine without it exits; the launch must not wait for
    it forever but stop the server (which still writes its summary) and name the cause."""
    cluster = _cluster(small_hsi, tmp_path, devices=("cuda:0",))
    with pytest.raises(PSError, match=r"w0-x1 exited with code 1: .*CUDA"):
        run_local(cluster)
    assert _processes_marked(mark) == []
    assert (tmp_path / "summary.json").exists()


def test_a_worker_failing_at_start_stops_the_launch_while_the_others_wait(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    """``--devices cuda:0,cpu`` without CUDA: the CPU worker joins and waits for the other, the
    server waits for both; the launch must stop with the failing worker's error instead."""
    run_dir = tmp_path / "run"
    launcher = _start_pslaunch(
        *("local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--mode", "weighted-sync"),
        *("--slowdowns", "1,1", "--devices", "cuda:0,cpu", "--epochs", "2"),
        *("--run-dir", str(run_dir), "--no-progress"),
    )
    begin = time.monotonic()
    try:
        _, err = launcher.communicate(timeout=WAIT_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert time.monotonic() - begin < WAIT_S / 2  # ended by the error, not by a wait
    assert launcher.returncode not in (0, None)
    assert re.search(r"w0-x1 exited with code 1: .*CUDA", err), err
    assert _processes_marked(mark) == []


def test_a_variable_for_pserver_start_does_not_reach_the_launchers_server(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    """``PSERVER_START_OVERWRITE=1`` names ``pserver start``, not ``pslaunch local``: the
    launcher's server must still refuse the earlier run instead of deleting it."""
    earlier = {"metrics.jsonl": '{"event": "start"}\n', "summary.json": "{}"}
    for name, text in earlier.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PSERVER_START_OVERWRITE": "1", "WORKER_JOIN_SLOWDOWN": "bogus"}
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "local", "--dataset", str(small_hsi), "--epochs", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=WAIT_S,
        env={**env, "PSLAUNCH_LOCAL_MODEL": "hsi-cnn", "PSLAUNCH_LOCAL_RUN_DIR": str(tmp_path)},
    )
    assert done.returncode == 1 and "already holds a run" in done.stderr, done.stderr
    assert {name: (tmp_path / name).read_text() for name in earlier} == earlier
    assert _processes_marked(mark) == []


def test_children_get_no_variable_of_the_option_scheme() -> None:
    environ = {"PATH": "/bin", "PSERVER_START_MODE": "async", "WORKER_JOIN_NAME": "w"}
    environ |= {"PSLAUNCH_LOCAL_WORKERS": "3", "RS_PSERVER_TEST_MARK": "m"}
    env = child_environment(environ, PYTHONUNBUFFERED="1")
    assert env == {"PATH": "/bin", "RS_PSERVER_TEST_MARK": "m", "PYTHONUNBUFFERED": "1"}


def _start_pslaunch(*args: str) -> subprocess.Popen[str]:
    """``pslaunch ARGS`` as a user starts it, in its own process group (like a terminal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )


def _interrupt(launcher: subprocess.Popen[str], send: Callable[[], None], mark: str) -> None:
    """Call ``send`` (a signal to the launcher), then check that it exits 130 saying it was
    interrupted and that no process it started is left; killed with its group if it hangs."""
    try:
        send()
        _, err = launcher.communicate(timeout=WAIT_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 130, err
    assert "interrupted" in err
    assert _processes_marked(mark) == []


def _wait_for_training(run_dir: Path, launcher: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and launcher.poll() is None:
        if metrics.exists() and '"event": "push"' in metrics.read_text(encoding="utf-8"):
            return
        time.sleep(0.2)
    raise AssertionError(f"training did not start (pslaunch exit code {launcher.poll()})")


@pytest.mark.parametrize(
    ("signum", "target"),
    [(signal.SIGTERM, "launcher"), (signal.SIGINT, "group")],
    ids=["sigterm-to-pslaunch", "ctrl-c-in-the-terminal"],
)
def test_a_stopped_launch_stops_every_child_and_keeps_the_summary(
    small_hsi: Path, tmp_path: Path, mark: str, signum: int, target: str
) -> None:
    run_dir = tmp_path / "run"
    launcher = _start_pslaunch(
        *("local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--mode", "async"),
        *("--slowdowns", "1,2", "--epochs", "1000", "--run-dir", str(run_dir)),
        "--server-opt=--shutdown-timeout=30",
    )
    try:
        _wait_for_training(run_dir, launcher)
        assert len(_processes_marked(mark)) == 4  # pslaunch, its server and 2 workers
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
        raise
    if target == "launcher":
        _interrupt(launcher, lambda: launcher.send_signal(signum), mark)
    else:  # what Ctrl-C does: the whole foreground group
        _interrupt(launcher, lambda: os.killpg(launcher.pid, signum), mark)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["finish_reason"] == "stopped" and summary["steps"] > 0


def test_a_failing_ddp_rank_stops_the_others_with_its_error(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    """Rank 1 asks for CUDA on a machine without it: rank 0 would wait at the rendezvous until
    its timeout; the launcher must stop it at once and name the failing rank's error."""
    config = DDPConfig(
        dataset=small_hsi,
        model="hsi-cnn",
        slowdowns=(1.0, 1.0),
        run_dir=tmp_path,
        train=TrainSettings(epochs=2),
        devices=("cpu", "cuda:0"),
        startup_timeout_s=WAIT_S,
    )
    begin = time.monotonic()
    with pytest.raises(PSError, match=r"DDP rank r1-x1 exited with code 1: .*CUDA"):
        run_ddp(config)
    assert time.monotonic() - begin < WAIT_S / 2
    assert _processes_marked(mark) == []


def test_sigterm_to_pslaunch_ddp_stops_every_rank(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    launcher = _start_pslaunch(
        *("ddp", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--slowdowns", "1,2"),
        *("--epochs", "1000", "--run-dir", str(tmp_path / "run")),
    )
    deadline = time.monotonic() + WAIT_S
    while len(_processes_marked(mark)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # pslaunch and its 2 ranks
    ranks_up = len(_processes_marked(mark)) == 3
    _interrupt(launcher, lambda: launcher.send_signal(signal.SIGTERM), mark)
    assert ranks_up
