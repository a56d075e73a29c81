"""A local cluster: one server process and N worker processes on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from common.errors import ConfigError, PSError

log = logging.getLogger(__name__)

LISTENING = re.compile(r"pserver listening on (\S+)")


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """What ``pslaunch local`` runs.

    Attributes:
        dataset, model, mode: as for ``pserver start``.
        slowdowns: one slowdown factor per worker.
        run_dir: the server's run directory (metrics.jsonl, summary.json, logs).
        server_options: further ``pserver start`` options, e.g. ``["--epochs", "5"]``.
        devices: one device per worker (``cpu``, ``cuda:N``), or one for all.
        slowdown_schedules: per worker, ``STEP:F,...`` changes of its slowdown ("" for none).
        worker_options: further ``worker join`` options for every worker.
        startup_timeout_s: how long the server may take to start listening.
        run_timeout_s: how long the whole run may take before it is stopped.
    """

    dataset: Path
    model: str
    mode: str
    slowdowns: tuple[float, ...]
    run_dir: Path
    server_options: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    slowdown_schedules: tuple[str, ...] = ()
    worker_options: tuple[str, ...] = ()
    startup_timeout_s: float = 120.0
    run_timeout_s: float = 3600.0

    def validate(self) -> LocalCluster:
        """Check the worker list.

        Raises:
            ConfigError: no workers, a slowdown below 1, or a device list of the wrong length.
        """
        if not self.slowdowns:
            raise ConfigError("give at least one worker")
        if any(s < 1 for s in self.slowdowns):
            raise ConfigError(f"slowdowns must be >= 1, got {list(self.slowdowns)}")
        if self.slowdown_schedules and len(self.slowdown_schedules) != len(self.slowdowns):
            raise ConfigError(
                f"{len(self.slowdown_schedules)} slowdown schedules for "
                f"{len(self.slowdowns)} workers"
            )
        if len(self.devices) not in (1, len(self.slowdowns)):
            raise ConfigError(
                f"--devices lists {len(self.devices)} devices for {len(self.slowdowns)} workers"
            )
        return self


def _python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def pump(
    stream: IO[str],
    sink: IO[str],
    prefix: str,
    found: threading.Event | None = None,
    box: list[str] | None = None,
) -> None:
    """Copy a child's output to ``sink``; optionally catch the server's listening address.

    Args:
        stream: the child's text output, read to its end and then closed.
        sink: where each line goes, after ``prefix``.
        prefix: e.g. ``"[server] "``.
        found: set once a line announces the server's address.
        box: receives that address.
    """
    with stream:  # the pipe is closed once the child has closed its end
        for line in stream:
            if found is not None and box is not None and not found.is_set():
                match = LISTENING.search(line)
                if match:
                    box.append(match.group(1))
                    found.set()
            sink.write(prefix + line)
            sink.flush()


def run_local(cluster: LocalCluster, log_stream: IO[str] | None = None) -> dict[str, Any]:
    """Run the server and workers to completion and return the summary.

    Ctrl-C (or any error) sends SIGTERM to the server, which tells the workers to stop; all
    processes are waited for, and killed if they outlive their timeout.

    Args:
        cluster: what to run.
        log_stream: where the processes' logs go (default: ``run_dir/cluster.log``).

    Returns:
        The parsed ``summary.json``.

    Raises:
        PSError: the server failed to start, a process failed, or no summary was written.
    """
    cluster.validate()
    cluster.run_dir.mkdir(parents=True, exist_ok=True)
    own_log = log_stream is None
    sink = log_stream or (cluster.run_dir / "cluster.log").open("w", encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server_cmd = _python_module(
        "pserver.cli",
        "start",
        "--bind",
        "tcp://127.0.0.1:0",
        "--dataset",
        str(cluster.dataset),
        "--model",
        cluster.model,
        "--mode",
        cluster.mode,
        "--workers",
        str(len(cluster.slowdowns)),
        "--run-dir",
        str(cluster.run_dir),
        *cluster.server_options,
    )
    server = subprocess.Popen(
        server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    listening, box = threading.Event(), []
    pumps = [
        threading.Thread(
            target=pump, args=(server.stderr, sink, "[server] ", listening, box), daemon=True
        )
    ]
    pumps[0].start()
    workers: list[subprocess.Popen[str]] = []
    try:
        if not listening.wait(cluster.startup_timeout_s) or server.poll() is not None:
            raise PSError(
                f"the server did not start (exit code {server.poll()}); "
                f"see {cluster.run_dir / 'cluster.log'}"
            )
        address = box[0]
        for i, slowdown in enumerate(cluster.slowdowns):
            device = cluster.devices[i if len(cluster.devices) > 1 else 0]
            name = f"w{i}-x{slowdown:g}"
            schedule = cluster.slowdown_schedules[i] if cluster.slowdown_schedules else ""
            args = ["--server", address, "--device", device, "--slowdown", str(slowdown)]
            args += ["--name", name, "--slowdown-schedule", schedule]
            if ":" in cluster.model:  # a user model: the worker must be allowed to import it
                args += ["--allow-model", cluster.model]
            proc = subprocess.Popen(
                _python_module("worker.cli", "join", *args, *cluster.worker_options),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            workers.append(proc)
            thread = threading.Thread(
                target=pump, args=(proc.stdout, sink, f"[{name}] "), daemon=True
            )
            thread.start()
            pumps.append(thread)
        code = server.wait(timeout=cluster.run_timeout_s)
        failed = [w.wait(timeout=60) for w in workers]
        if code != 0:
            raise PSError(f"the server exited with code {code}; see the log")
        if any(failed):
            log.warning("worker exit codes: %s", failed)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        _stop(server, workers)
        raise
    except BaseException:
        _stop(server, workers)
        raise
    finally:
        for thread in pumps:
            thread.join(timeout=5)
        if own_log:
            sink.close()
    summary_path = cluster.run_dir / "summary.json"
    if not summary_path.exists():
        raise PSError(f"the server wrote no {summary_path}")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    summary["worker_exit_codes"] = failed
    return summary


def _stop(server: subprocess.Popen[str], workers: Sequence[subprocess.Popen[str]]) -> None:
    """Ask the server to stop (it stops the workers), then kill whatever is left."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    for proc in (server, *workers):
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
