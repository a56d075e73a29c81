"""Real server and worker processes for reliability tests, driven by their log lines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LINE_TIMEOUT_S = 180.0
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


class Proc:
    """A child process whose merged output is read line by line on a thread."""

    def __init__(self, args: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = LINE_TIMEOUT_S) -> str:
        """Block until a line containing ``text`` appears; return it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name} printed no {text!r} within {timeout:g} s:\n"
                    + "".join(self.seen[-80:])
                ) from None
            if line is None:
                raise AssertionError(
                    f"{self.name} ended before printing {text!r}:\n" + "".join(self.seen[-80:])
                )
            self.seen.append(line)
            if text in line:
                return line

    def expect(self, text: str, timeout: float = LINE_TIMEOUT_S) -> str:
        """Like ``wait_for``, but a line already read counts too."""
        seen = next((line for line in self.seen if text in line), None)
        return seen if seen is not None else self.wait_for(text, timeout)

    def wait(self, timeout: float = LINE_TIMEOUT_S) -> int:
        """Wait for exit, draining output."""
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout:g} s:\n" + "".join(self.seen[-80:])
            ) from None
        self._reader.join(timeout=10)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.seen.append(line)
        if self.popen.stdout is not None and not self._reader.is_alive():
            self.popen.stdout.close()
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(timeout=10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def start_server(
    dataset: Path, run_dir: Path, *options: str, bind: str = "tcp://127.0.0.1:0"
) -> tuple[Proc, str]:
    """``pserver start`` (on a random port by default); returns the process and its address."""
    server = Proc(
        [
            "pserver.cli",
            "start",
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
        "server",
    )
    line = server.wait_for("listening on")
    return server, line.split("listening on", 1)[1].strip()


def start_worker(address: str, name: str, slowdown: float = 1.0, *options: str) -> Proc:
    """``worker join`` against ``address``."""
    return Proc(
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


def start_shard(coordinator: str, name: str, *options: str) -> Proc:
    """``pserver shard`` for ``coordinator``, on a random loopback port."""
    return Proc(
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
