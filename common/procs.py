"""Child processes for launchers, benchmarks and tests, and facts about processes.

A ``Child`` runs in its own session, so its whole process group can be signalled; a thread
reads its output line by line (kept for waits and error messages, and passed on to a hook or a
log file); every wait has a timeout and every stop reaps. ``Children`` stops a group of them in
order. Facts about processes come from ``psutil`` (whether one runs here; callers read RSS and
CPU times from it too), a process's own peak RSS from ``/proc`` or ``resource.getrusage``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

import psutil

from common.errors import PSError, WaitTimeout
from common.polling import poll_until

KEEP_LINES = 10_000
TAIL_LINES = 40
POLL_S = 0.2
REAP_TIMEOUT_S = 30.0
WAIT_S = 180.0  # the bound of a wait on a child when the caller gives none


class ChildError(PSError):
    """A child process failed, timed out, or ended before printing what was waited for."""


class TextSink(Protocol):
    """Where children's output goes: a text file, or anything with ``write`` and ``flush``."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> None: ...


class Child:
    """One child process in its own session, its output read line by line on a thread.

    Args:
        name: its name in logs and errors.
        argv: the command line.
        env: its whole environment (None: this process's).
        cwd: its working directory (None: this process's).
        on_line: sees each output line (called on the reading thread).
        log_path: a file that receives the output as it comes (closed when the output ends).
        stderr_only: read only stderr; stdout goes to /dev/null.
        keep_lines: how many of the last lines are kept for ``wait_for`` and ``output``.

    Raises:
        OSError: the command cannot be started.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        on_line: Callable[[str], None] | None = None,
        log_path: Path | None = None,
        stderr_only: bool = False,
        keep_lines: int = KEEP_LINES,
    ) -> None:
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._read_count = 0  # lines read so far; the deque holds the last of them
        self._cursor = 0  # where the next ``wait_for`` starts (a count of lines)
        self._ended = False
        self._cond = threading.Condition()
        self._on_line = on_line
        self._log: IO[str] | None = (
            log_path.open("w", encoding="utf-8") if log_path is not None else None
        )
        try:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if stderr_only else subprocess.PIPE,
                stderr=subprocess.PIPE if stderr_only else subprocess.STDOUT,
                text=True,
                encoding="utf-8",
                errors="replace",
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        except OSError:
            if self._log is not None:
                self._log.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"output-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The process id (also its process group's)."""
        return self.popen.pid

    @property
    def code(self) -> int | None:
        """The exit code, None while it runs."""
        return self.popen.poll()

    def _read(self) -> None:
        stream = self.popen.stdout or self.popen.stderr
        assert stream is not None
        try:
            with stream:  # closed once every process holding its other end has closed it
                for line in stream:
                    if self._log is not None:
                        self._log.write(line)
                        self._log.flush()
                    if self._on_line is not None:
                        self._on_line(line)
                    with self._cond:
                        self.lines.append(line)
                        self._read_count += 1
                        self._cond.notify_all()
        finally:
            if self._log is not None:
                self._log.close()
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _await_line(
        self, test: Callable[[str], bool], start: int, timeout: float, what: str
    ) -> str:
        """The first line from the ``start``-th line on that passes ``test``; moves the cursor
        past it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                first = self._read_count - len(self.lines)  # the count of the oldest line kept
                for index in range(max(start, first), self._read_count):
                    line = self.lines[index - first]
                    if test(line):
                        self._cursor = index + 1
                        return line
                start = self._read_count
                if self._ended:
                    raise ChildError(f"{self.name} ended before printing {what}\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise ChildError(
                        f"{self.name} printed no {what} within {timeout:g} s\n{self.tail()}"
                    )

    def wait_for(self, text: str, timeout: float = WAIT_S) -> str:
        """Wait for the next line that contains ``text``, after the line the previous
        ``wait_for`` or ``wait_for_match`` returned.

        Args:
            text: a plain substring.
            timeout: seconds to wait at most.

        Returns:
            The line, with its newline.

        Raises:
            ChildError: the output ended or the time ran out first.
        """
        return self._await_line(lambda line: text in line, self._cursor, timeout, repr(text))

    def expect(self, text: str, timeout: float = WAIT_S) -> str:
        """Like ``wait_for``, but any line read so far counts too (the first one that matches).

        Raises:
            ChildError: the output ended or the time ran out first.
        """
        cursor = self._cursor
        line = self._await_line(lambda line: text in line, 0, timeout, repr(text))
        self._cursor = max(cursor, self._cursor)
        return line

    def wait_for_match(self, pattern: str, timeout: float = WAIT_S) -> re.Match[str]:
        """Wait for a line in which the regular expression ``pattern`` is found, from the first
        line read on (lines already read count).

        Returns:
            The match.

        Raises:
            ChildError: the output ended or the time ran out first.
        """
        regex = re.compile(pattern)
        line = self._await_line(
            lambda line: regex.search(line) is not None, 0, timeout, f"/{pattern}/"
        )
        match = regex.search(line)
        assert match is not None
        return match

    def output(self) -> str:
        """The lines kept so far, joined."""
        with self._cond:
            return "".join(self.lines)

    def tail(self, count: int = TAIL_LINES) -> str:
        """The last ``count`` output lines, indented and labelled, for error messages."""
        with self._cond:
            lines = list(self.lines)[-count:]
        return "\n".join(f"    [{self.name}] {line.rstrip()}" for line in lines)

    def error_line(self, last: bool = True) -> str:
        """The last line that reports an error, else (with ``last``) the last line ("" if
        none)."""
        with self._cond:
            lines = [line.strip() for line in list(self.lines)[-TAIL_LINES:] if line.strip()]
        for line in reversed(lines):
            if "error" in line.lower() or "exception" in line.lower():
                return line
        return lines[-1] if lines and last else ""

    def failure(self) -> str:
        """A one-line account of how the child ended: its exit code and error line, or the
        signal that killed it (and an error line only if it printed one)."""
        code = self.code
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "a signal"
            how, line = f"was killed by {name} (signal {-code})", self.error_line(last=False)
        else:
            how, line = f"exited with code {code}", self.error_line()
        return f"{self.name} {how}" + (f": {line}" if line else "")

    def wait(self, timeout: float = WAIT_S) -> int:
        """Wait for the process to exit, then for its output to be read.

        Args:
            timeout: seconds.

        Returns:
            Its exit code.

        Raises:
            ChildError: it did not exit in time (it is left running; ``stop`` or ``kill`` it).
        """
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ChildError(
                f"{self.name} did not exit within {timeout:g} s\n{self.tail()}"
            ) from exc
        self.drain()
        return code

    def drain(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for the reading thread to reach the end of the output
        (a grandchild that keeps the pipe open can hold it longer)."""
        self._reader.join(timeout=timeout)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's process group (nothing if it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def kill(self) -> None:
        """Kill the process group now and reap the child."""
        self.signal_group(signal.SIGKILL)
        self.popen.wait(timeout=REAP_TIMEOUT_S)
        self.drain()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds, reap the child."""
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)
        self.kill()  # also whatever the child left running in its group


class Children:
    """Start, watch and stop a group of children whose output goes to one sink.

    Args:
        sink: where every child's output goes, each line prefixed with ``[name] `` (None:
            nowhere; lines are still kept by each ``Child``).
        env: the children's environment (None: this process's).
        cwd: their working directory (None: this process's).
    """

    def __init__(
        self,
        sink: TextSink | None = None,
        env: Mapping[str, str] | None = None,
        *,
        cwd: Path | str | None = None,
    ) -> None:
        self.sink, self.env, self.cwd = sink, env, cwd
        self.children: list[Child] = []
        self._sink_lock = threading.Lock()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close()

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        on_line: Callable[[str], None] | None = None,
        stderr_only: bool = False,
        log_path: Path | None = None,
    ) -> Child:
        """Start ``cmd`` in a new session.

        Args:
            name: the child's name in the log and in errors.
            cmd: the command line.
            on_line: sees each output line (called on the reading thread).
            stderr_only: read only stderr (e.g. the server prints its summary on stdout).
            log_path: a file of the child's own that receives its output too.

        Returns:
            The child.
        """

        def forward(line: str) -> None:
            if on_line is not None:
                on_line(line)
            if self.sink is not None:
                with self._sink_lock:
                    self.sink.write(f"[{name}] {line}")
                    self.sink.flush()

        child = Child(
            name,
            cmd,
            env=self.env,
            cwd=self.cwd,
            on_line=forward,
            log_path=log_path,
            stderr_only=stderr_only,
        )
        self.children.append(child)
        return child

    def wait(self, main: Child, timeout_s: float, check: Callable[[], None] = lambda: None) -> int:
        """Wait until ``main`` exits, calling ``check`` (which may raise) every poll.

        Returns:
            ``main``'s exit code.

        Raises:
            ChildError: ``main`` did not exit within ``timeout_s``.
        """

        def exited() -> bool:
            if main.code is not None:
                return True
            check()
            return False

        try:
            poll_until(exited, timeout_s, POLL_S, f"{main.name} to finish")
        except WaitTimeout as exc:
            raise ChildError(f"{main.name} did not finish within {timeout_s:g} s") from exc
        code = main.code
        assert code is not None
        return code

    def wait_all(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` in all for every child to exit; True if they all did."""
        try:
            poll_until(lambda: all(c.code is not None for c in self.children), timeout_s, POLL_S)
        except WaitTimeout:
            return False
        return True

    def stop(
        self, first: Child | None = None, first_grace_s: float = 0.0, grace_s: float = 10.0
    ) -> None:
        """Stop every child still running: SIGTERM to ``first`` (the server), which may take
        ``first_grace_s`` to wind down, then SIGTERM to the rest; whatever is left after
        ``grace_s`` is killed with its process group. Every child is reaped."""
        if first is not None and first.code is None:
            first.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                first.popen.wait(timeout=first_grace_s)
        for child in self.children:
            if child.code is None:
                child.signal_group(signal.SIGTERM)
        self.wait_all(grace_s)
        for child in self.children:  # the ones left, and anything a child left in its group
            child.signal_group(signal.SIGKILL)
        for child in self.children:
            child.popen.wait(timeout=REAP_TIMEOUT_S)

    def kill_groups(self) -> None:
        """SIGKILL every child's process group (safe in a signal handler: it does not wait)."""
        for child in self.children:
            child.signal_group(signal.SIGKILL)

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for the children's output to be read to its end (their pipes close with them)."""
        for child in self.children:
            child.drain(timeout_s)


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def peak_rss_bytes() -> int:
    """The peak resident set size of this program.

    Linux's ``getrusage`` carries the parent's size at fork into a child's maximum across
    ``exec``, so a small program started by a large one would report the large one's size:
    the peak is read from ``VmHWM`` in ``/proc/self/status`` (the address space since
    ``exec``) where that exists, else from ``getrusage`` (Linux reports kibibytes, macOS bytes).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
