"""Launches as a user starts them: the mark every process of a test carries, ``pslaunch``
started as from a terminal, and waits on a launch's progress."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from common.polling import poll_until
from common.procs import Child
from tests.support.paths import ROOT

LAUNCH_WAIT_S = 180.0
MARK = "RS_PSERVER_TEST_MARK"  # not a PSLAUNCH_* name: launchers pass those on to no child


def processes_marked(mark: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose environment holds ``MARK=mark``: a
    launcher's children inherit it, wherever they were reparented."""
    found = []
    for proc in psutil.process_iter(["environ", "status"]):
        environ = proc.info["environ"] or {}
        if (
            proc.pid != os.getpid()
            and environ.get(MARK) == mark
            and proc.info["status"] != psutil.STATUS_ZOMBIE
        ):
            found.append(proc.pid)
    return found


def start_pslaunch(*args: str, env: Mapping[str, str] | None = None) -> Child:
    """``pslaunch ARGS`` as a user starts it, in its own process group (like a terminal); its
    stderr is kept.

    Args:
        args: the subcommand and its options.
        env: its environment (None: this process's).
    """
    return Child(
        "pslaunch",
        [sys.executable, "-m", "launch.cli", *args],
        env=env,
        cwd=ROOT,
        stderr_only=True,
    )


def wait_for_training(run_dir: Path, launcher: Child, timeout: float = LAUNCH_WAIT_S) -> None:
    """Wait until the run's ``metrics.jsonl`` holds a ``push`` event; fail at once if the
    launcher exits first."""
    metrics = run_dir / "metrics.jsonl"

    def pushed() -> bool:
        if metrics.exists() and '"event": "push"' in metrics.read_text(encoding="utf-8"):
            return True
        if launcher.code is not None:
            raise AssertionError(f"training did not start: {launcher.failure()}")
        return False

    poll_until(pushed, timeout, 0.2, f"a push event in {metrics}")


def stop_launcher(launcher: Child, send: Callable[[], None], timeout: float) -> int:
    """Call ``send`` (a signal to the launcher) and wait for it to exit; its group is killed
    if it does not.

    Returns:
        Its exit code.
    """
    try:
        send()
        return launcher.wait(timeout)
    finally:
        if launcher.code is None:
            launcher.kill()
