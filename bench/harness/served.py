"""A server and its workers started from a given checkout: benches that compare two trees run
the same job on each."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.cli_env import child_environment
from common.procs import Child, Children
from launch.procs import EventsMark, wait_for_address


@dataclass(frozen=True)
class ServedRun:
    """A running job: its server and the address it listens on, its workers, where its events
    begin, and the group that stops them (and any other child started with it) when it ends."""

    server: Child
    address: str
    workers: list[Child]
    metrics: Path
    mark: EventsMark
    children: Children


@contextlib.contextmanager
def served_run(
    code: Path,
    run_dir: Path,
    server_options: Sequence[str],
    workers: int,
    *,
    start_timeout_s: float,
    stop_grace_s: float,
) -> Iterator[ServedRun]:
    """``pserver start`` on 127.0.0.1 with ``server_options`` and ``run_dir``, and ``workers``
    workers joining it, every process importing ``code``; stopped, reaped and closed when the
    block ends.

    Args:
        code: the checkout the processes run (``python -m`` from there puts it first on their
            path).
        run_dir: the run's directory (created; must not exist); ``cluster.log`` holds the
            processes' output.
        server_options: ``pserver start`` options beyond ``--bind`` and ``--run-dir``.
        workers: how many ``worker join`` processes to start once the server is up.
        start_timeout_s: how long the server may take to write its ``start`` event.
        stop_grace_s: how long the server may take to end after SIGTERM.
    """
    env = child_environment(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(code))
    run_dir.mkdir(parents=True)
    metrics = run_dir / "metrics.jsonl"
    python = [sys.executable, "-m"]
    with (run_dir / "cluster.log").open("w", encoding="utf-8") as log:
        children = Children(log, env, cwd=code)
        mark = EventsMark(metrics)
        server = children.start(
            "server",
            [
                *(*python, "pserver.cli", "start", "--bind", "tcp://127.0.0.1:0"),
                *("--run-dir", str(run_dir), *server_options),
            ],
            stderr_only=True,
        )
        try:
            address = wait_for_address(server, metrics, mark, start_timeout_s)
            joined = [
                children.start(f"w{i}", [*python, "worker.cli", "join", "--server", address])
                for i in range(workers)
            ]
            yield ServedRun(server, address, joined, metrics, mark, children)
        finally:
            children.stop(server, first_grace_s=stop_grace_s)
            children.close()
            mark.close()
