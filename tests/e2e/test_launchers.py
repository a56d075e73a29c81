"""``pslaunch local`` watches its children: fails fast with their error, forwards signals, never
leaves orphans, and lets the server write its summary when stopped."""

from __future__ import annotations

import contextlib
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
from common.errors import PSError, WaitTimeout
from common.polling import poll_until
from common.procs import Child, Children
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.local import LocalCluster, run_local
from launch.procs import EventsMark
from launch.restarts import Supervisor
from launch.settings import TrainSettings
from tests.support.launches import (
    MARK,
    processes_marked,
    start_pslaunch,
    stop_launcher,
    wait_for_training,
)
from tests.support.paths import ROOT

WAIT_S = 120.0


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
    assert processes_marked(mark) == []


def test_the_only_worker_failing_ends_the_run_with_its_error(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    """A worker asking for CUDA on a machine without it exits; the launch must not wait for
    it forever but stop the server (which still writes its summary) and name the cause."""
    cluster = _cluster(small_hsi, tmp_path, devices=("cuda:0",))
    with pytest.raises(PSError, match=r"w0-x1 exited with code 1: .*CUDA"):
        run_local(cluster)
    assert processes_marked(mark) == []
    assert (tmp_path / "summary.json").exists()


@pytest.mark.exclusive  # asserts how long the stop took
def test_a_worker_failing_at_start_stops_the_launch_while_the_others_wait(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    """``--devices cuda:0,cpu`` without CUDA: the CPU worker joins and waits for the other, the
    server waits for both; the launch must stop with the failing worker's error instead."""
    run_dir = tmp_path / "run"
    launcher = start_pslaunch(
        *("local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--mode", "weighted-sync"),
        *("--slowdowns", "1,1", "--devices", "cuda:0,cpu", "--epochs", "2"),
        *("--run-dir", str(run_dir), "--no-progress"),
    )
    begin = time.monotonic()
    code = stop_launcher(launcher, lambda: None, WAIT_S)
    err = launcher.output()
    assert time.monotonic() - begin < WAIT_S / 2  # ended by the error, not by a wait
    assert code != 0
    assert re.search(r"w0-x1 exited with code 1: .*CUDA", err), err
    assert processes_marked(mark) == []


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
    assert processes_marked(mark) == []


def test_children_get_no_variable_of_the_option_scheme() -> None:
    environ = {"PATH": "/bin", "PSERVER_START_MODE": "async", "WORKER_JOIN_NAME": "w"}
    environ |= {"PSLAUNCH_LOCAL_WORKERS": "3", "RS_PSERVER_TEST_MARK": "m"}
    environ |= {"PSERVER_STAGE_TRACE": "/tmp/trace"}  # not an option: every process sees it
    env = child_environment(environ, PYTHONUNBUFFERED="1")
    assert env == {
        "PATH": "/bin",
        "RS_PSERVER_TEST_MARK": "m",
        "PSERVER_STAGE_TRACE": "/tmp/trace",
        "PYTHONUNBUFFERED": "1",
    }


def _interrupt(launcher: Child, send: Callable[[], None], mark: str) -> None:
    """Call ``send`` (a signal to the launcher), then check that it exits 130 saying it was
    interrupted and that no process it started is left; killed with its group if it hangs."""
    code = stop_launcher(launcher, send, WAIT_S)
    err = launcher.output()
    assert code == 130, err
    assert "interrupted" in err
    assert processes_marked(mark) == []


@pytest.mark.parametrize(
    ("signum", "target"),
    [(signal.SIGTERM, "launcher"), (signal.SIGINT, "group")],
    ids=["sigterm-to-pslaunch", "ctrl-c-in-the-terminal"],
)
def test_a_stopped_launch_stops_every_child_and_keeps_the_summary(
    small_hsi: Path, tmp_path: Path, mark: str, signum: int, target: str
) -> None:
    run_dir = tmp_path / "run"
    launcher = start_pslaunch(
        *("local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--mode", "async"),
        *("--slowdowns", "1,2", "--epochs", "1000", "--run-dir", str(run_dir)),
        "--server-opt=--shutdown-timeout=30",
    )
    try:
        wait_for_training(run_dir, launcher, WAIT_S)
        assert len(processes_marked(mark)) == 4  # pslaunch, its server and 2 workers
    except BaseException:
        launcher.kill()
        raise
    if target == "launcher":
        _interrupt(launcher, lambda: launcher.popen.send_signal(signum), mark)
    else:  # what Ctrl-C does: the whole foreground group
        _interrupt(launcher, lambda: launcher.signal_group(signum), mark)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["finish_reason"] == "stopped" and summary["steps"] > 0


@pytest.mark.exclusive  # asserts how long the stop took
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
    assert processes_marked(mark) == []


def test_sigterm_to_pslaunch_ddp_stops_every_rank(
    small_hsi: Path, tmp_path: Path, mark: str
) -> None:
    launcher = start_pslaunch(
        *("ddp", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--slowdowns", "1,2"),
        *("--epochs", "1000", "--run-dir", str(tmp_path / "run")),
    )
    with contextlib.suppress(WaitTimeout):  # pslaunch and its 2 ranks
        poll_until(lambda: len(processes_marked(mark)) >= 3, WAIT_S, 0.2, "2 DDP ranks")
    ranks_up = len(processes_marked(mark)) == 3
    _interrupt(launcher, lambda: launcher.popen.send_signal(signal.SIGTERM), mark)
    assert ranks_up


def test_workers_not_joined_when_the_server_ends_are_stopped_the_others_left_to_end(
    tmp_path: Path,
) -> None:
    """A worker that joined is left to end by itself, and so is one brought back that joined
    again (as ``NAME-<id>``: the server still counted it); one that never joined, and one
    brought back that has not joined again, are stopped at once and count as taken out."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.touch()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]

    def joins(*names: str) -> None:
        with metrics.open("a") as f:
            f.writelines(json.dumps({"event": "join", "worker": n}) + "\n" for n in names)

    events_mark = EventsMark(metrics)
    with Children() as children:
        supervisor = Supervisor(
            children=children,
            run_dir=tmp_path,
            restarts=0,
            server_argv=lambda extra: [],
            shard_argvs=lambda address: [],
            startup_timeout_s=WAIT_S,
            marks=[events_mark],
            set_budget=lambda index, cores: None,
        )
        names = ("joined", "late", "back", "again")
        supervisor.start_workers([(name, sleeper) for name in names])
        joins("joined", "back", "again")
        for index in (2, 3):
            supervisor.leave(index)
            supervisor.rejoin(index)
        joins("again-5")
        supervisor.stop_unjoined()
        codes = {name: worker.code for name, worker in zip(names, supervisor.workers, strict=True)}
        assert codes["joined"] is None and codes["again"] is None, codes
        assert codes["late"] is not None and codes["back"] is not None, codes
        assert supervisor.away == {1, 2}
    events_mark.close()
