"""Real server, shard and worker processes for tests: a server is ready once its ``start`` event
is written; the tests follow the processes by their log lines."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.procs import Child
from launch.procs import EventsMark, wait_for_address
from tests.support.paths import ROOT

STARTUP_TIMEOUT_S = 180.0
_SECRETS: list[Path] = []


def shard_secret() -> Path:
    """This test process's shard secret file (made once), for servers with --shards and their
    shards."""
    if not _SECRETS:
        from common.protocol.security import write_shard_secret

        directory = Path(tempfile.mkdtemp(prefix="test-shards-"))
        _SECRETS.append(write_shard_secret(directory / "shard.secret"))
    return _SECRETS[0]


def _with_secret(options: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """``options`` plus ``flag shard_secret()`` unless they give a secret or CURVE keys."""
    if any(
        o.startswith(("--shard-secret-file", "--secret-file", "--curve-secret")) for o in options
    ):
        return options
    return (*options, flag, str(shard_secret()))


def start_module(args: Sequence[str], name: str, env: Mapping[str, str] | None = None) -> Child:
    """``python -m ARGS`` from the project root, unbuffered, its output kept line by line.

    Args:
        args: the module and its arguments.
        name: the child's name in errors.
        env: its environment (None: this process's).
    """
    return Child(
        name,
        [sys.executable, "-m", *args],
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )


def start_pserver(
    args: Sequence[str], run_dir: Path, env: Mapping[str, str] | None = None
) -> tuple[Child, str]:
    """``pserver start ARGS`` (which must write to ``run_dir``); returns the process and the
    address of its ``start`` event."""
    metrics = run_dir / "metrics.jsonl"
    mark = EventsMark(metrics)
    try:
        server = start_module(["pserver.cli", "start", *args], "server", env)
        try:
            return server, wait_for_address(server, metrics, mark, STARTUP_TIMEOUT_S)
        except BaseException:
            server.kill()
            raise
    finally:
        mark.close()


def start_server(
    dataset: Path, run_dir: Path, *options: str, bind: str = "tcp://127.0.0.1:0"
) -> tuple[Child, str]:
    """``pserver start`` (on a random port by default); returns the process and its address."""
    return start_pserver(
        [
            "--bind",
            bind,
            "--dataset",
            str(dataset),
            "--model",
            "hsi-cnn",
            "--run-dir",
            str(run_dir),
            *(_with_secret(options, "--shard-secret-file") if "--shards" in options else options),
        ],
        run_dir,
    )


def start_worker(address: str, name: str, slowdown: float = 1.0, *options: str) -> Child:
    """``worker join`` against ``address``."""
    return start_module(
        [
            "worker.cli",
            "join",
            "--server",
            address,
            "--name",
            name,
            "--slowdown",
            str(slowdown),
            "--log-every",
            "1000000",
            *options,
        ],
        name,
    )


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records."""
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def summary(run_dir: Path) -> dict[str, Any]:
    """The run's summary.json."""
    return json.loads((run_dir / "summary.json").read_text())


def start_shard(coordinator: str, name: str, *options: str) -> Child:
    """``pserver shard`` for ``coordinator``, on a random loopback port."""
    return start_module(
        [
            "pserver.cli",
            "shard",
            "--coordinator",
            coordinator,
            "--bind",
            "tcp://127.0.0.1:0",
            "--name",
            name,
            *_with_secret(options, "--secret-file"),
        ],
        name,
    )
