"""Child processes for benchmarks: output logged and watched line by line, always reaped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from common.errors import PSError

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 40


class ChildError(PSError):
    """A child process failed, timed out or never printed what it was waited for."""


class Child:
    """A process in its own session (so its whole group can be killed), output to a log file.

    Args:
        name: a label for logs and errors.
        argv: the command line (e.g. ``Host.argv([...])`` to run it inside a namespace).
        log_path: receives the merged stdout and stderr.
        env: extra environment variables.
    """

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._ended = False
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        self._sink = log_path.open("w", encoding="utf-8")
        try:
            self.popen = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                cwd=ROOT,
                env=full_env,
                start_new_session=True,
            )
        except OSError:
            self._sink.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._sink.write(line)
            self._sink.flush()
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until a line matches ``pattern``.

        Args:
            pattern: a regular expression searched in each output line.
            timeout: seconds to wait at most.

        Returns:
            The first match.

        Raises:
            ChildError: the process ended or the time ran out first.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                if self._ended:
                    raise ChildError(f"{self.name} ended before /{pattern}/\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise ChildError(f"{self.name}: no /{pattern}/ in {timeout:g} s\n{self.tail()}")

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit.

        Args:
            timeout: seconds.

        Returns:
            Its exit code.

        Raises:
            ChildError: it did not exit in time (it is left running; call ``stop``).
        """
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ChildError(
                f"{self.name} still running after {timeout:g} s\n{self.tail()}"
            ) from exc
        self._reader.join(timeout=5)
        return code

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds, reap, close the log."""
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.popen.wait(timeout=30)
        self._reader.join(timeout=5)
        if self.popen.stdout is not None and not self._reader.is_alive():
            self.popen.stdout.close()
        self._sink.close()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def tail(self, count: int = TAIL_LINES) -> str:
        """The last ``count`` output lines, indented, for error messages."""
        return "\n".join(f"    [{self.name}] {line}" for line in self.lines[-count:])


def python(module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
