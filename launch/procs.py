"""A launcher's child processes: each in its own process group, its output pumped into one log,
watched while the run goes, and stopped in order (server first, with its shutdown budget); and
the server's address, read from its ``start`` event in ``metrics.jsonl``.

Children run in their own sessions, so a Ctrl-C in the terminal reaches only the launcher, which
then asks the server to stop once (a second signal would make the server exit at once and lose
its summary); whatever outlives its grace period is killed with its whole process group.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any, Protocol

from common.errors import PSError

TAIL_LINES = 40
POLL_S = 0.2


class TextSink(Protocol):
    """Where children's output goes: a text file, or anything with ``write`` and ``flush``."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> None: ...


@dataclasses.dataclass
class Child:
    """One child process and the last lines it printed."""

    name: str
    popen: subprocess.Popen[str]
    tail: collections.deque[str]
    pump: threading.Thread | None = None

    @property
    def code(self) -> int | None:
        """The exit code, None while it runs."""
        return self.popen.poll()

    def error_line(self) -> str:
        """The child's last line that reports an error, else its last line ("" if none)."""
        lines = [line.strip() for line in self.tail if line.strip()]
        for line in reversed(lines):
            if "error" in line.lower() or "exception" in line.lower():
                return line
        return lines[-1] if lines else ""

    def failure(self) -> str:
        """A one-line account of how the child ended."""
        line = self.error_line()
        return f"{self.name} exited with code {self.code}" + (f": {line}" if line else "")


class Children:
    """Start, watch and stop a launcher's children.

    Args:
        sink: where every child's output goes, each line prefixed with ``[name] ``.
        env: the children's environment.
    """

    def __init__(self, sink: TextSink, env: dict[str, str]) -> None:
        self.sink, self.env = sink, env
        self.children: list[Child] = []
        self._sink_lock = threading.Lock()

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        on_line: Callable[[str], None] | None = None,
        stderr_only: bool = False,
    ) -> Child:
        """Start ``cmd`` in a new session.

        Args:
            name: the child's name in the log and in errors.
            cmd: the command line.
            on_line: sees each output line (called on the pump thread).
            stderr_only: log only stderr (the server prints its summary on stdout).
        """
        popen = subprocess.Popen(
            list(cmd),
            stdout=subprocess.DEVNULL if stderr_only else subprocess.PIPE,
            stderr=subprocess.PIPE if stderr_only else subprocess.STDOUT,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        child = Child(name, popen, collections.deque(maxlen=TAIL_LINES))
        child.pump = threading.Thread(target=self._pump, args=(child, on_line), daemon=True)
        self.children.append(child)
        child.pump.start()
        return child

    def _pump(self, child: Child, on_line: Callable[[str], None] | None) -> None:
        stream = child.popen.stdout or child.popen.stderr
        assert stream is not None
        with stream:  # closed once the child has closed its end
            for line in stream:
                child.tail.append(line)
                if on_line is not None:
                    on_line(line)
                with self._sink_lock:
                    self.sink.write(f"[{child.name}] {line}")
                    self.sink.flush()

    def wait(self, main: Child, timeout_s: float, check: Callable[[], None] = lambda: None) -> int:
        """Wait until ``main`` exits, calling ``check`` (which may raise) every poll.

        Raises:
            PSError: ``main`` did not exit within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return main.popen.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            check()
            if time.monotonic() > deadline:
                raise PSError(f"{main.name} did not finish within {timeout_s:g} s")

    def wait_all(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` in all for every child to exit; True if they all did."""
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(
        self, first: Child | None = None, first_grace_s: float = 0.0, grace_s: float = 10.0
    ) -> None:
        """Stop every child still running: SIGTERM to ``first`` (the server), which may take
        ``first_grace_s`` to wind down, then SIGTERM to the rest; whatever is left after
        ``grace_s`` is killed with its process group. Every child is reaped."""
        if first is not None and first.code is None:
            _signal_group(first.popen, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                first.popen.wait(timeout=first_grace_s)
        for child in self.children:
            if child.code is None:
                _signal_group(child.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                self.kill(child)
        for child in self.children:  # anything a child left in its group goes too
            _signal_group(child.popen, signal.SIGKILL)

    def kill(self, child: Child) -> None:
        """Kill ``child``'s process group now and reap it."""
        _signal_group(child.popen, signal.SIGKILL)
        child.popen.wait()

    def kill_groups(self) -> None:
        """SIGKILL every child's process group (safe in a signal handler: it does not wait)."""
        for child in self.children:
            _signal_group(child.popen, signal.SIGKILL)

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for the pumps to drain the children's output (their pipes close with them)."""
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=timeout_s)


class EventsMark:
    """Where the events of a server started now begin in ``metrics.jsonl``: after the current
    end of the file, or at 0 once the server has replaced it (``--overwrite``) or if there was
    none. The old file is held open, so its inode cannot be reused by the new one.

    Args:
        metrics: the run's ``metrics.jsonl`` (it may not exist yet).
    """

    def __init__(self, metrics: Path) -> None:
        self.metrics = metrics
        self._old: IO[bytes] | None = None
        self.size = 0
        with contextlib.suppress(FileNotFoundError):
            self._old = metrics.open("rb")
            self.size = os.fstat(self._old.fileno()).st_size

    def same_file(self, stat: os.stat_result) -> bool:
        """Whether ``stat`` (of the file now at the path) is the file that was there."""
        if self._old is None:
            return False
        old = os.fstat(self._old.fileno())
        return (old.st_dev, old.st_ino) == (stat.st_dev, stat.st_ino)

    def offset(self, stat: os.stat_result) -> int:
        """Where the new events begin in the file whose ``stat`` is given (0 also when the old
        file was truncated)."""
        return self.size if self.same_file(stat) and stat.st_size >= self.size else 0

    def close(self) -> None:
        """Let go of the old file."""
        if self._old is not None:
            self._old.close()
            self._old = None


def start_offset(metrics: Path) -> EventsMark:
    """Where a server started now will write its events (close the mark when done)."""
    return EventsMark(metrics)


def new_events(metrics: Path, mark: EventsMark | int) -> list[dict[str, Any]]:
    """The events written to ``metrics`` after ``mark`` (none while the file does not exist).

    Args:
        metrics: the run's ``metrics.jsonl``.
        mark: an ``EventsMark`` taken before the server started, or a byte offset (for a
            process that did not start the server; it cannot tell a replaced file).
    """
    try:
        with metrics.open("rb") as f:
            offset = mark if isinstance(mark, int) else mark.offset(os.fstat(f.fileno()))
            f.seek(offset)
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a line still being written
        if isinstance(record, dict):
            records.append(record)
    return records


def new_start_address(metrics: Path, mark: EventsMark | int) -> str | None:
    """The address of the last ``start`` event written after ``mark``, or None while there is
    none (a resumed run's file holds earlier servers' events before it).

    Args:
        metrics: the run's ``metrics.jsonl``.
        mark: as for ``new_events``.
    """
    address = None
    for record in new_events(metrics, mark):
        value = record.get("address")
        if record.get("event") == "start" and isinstance(value, str) and value:
            address = value
    return address


def joined_names(metrics: Path, mark: EventsMark | int) -> set[str]:
    """The names of the workers that joined the server after ``mark`` (``join`` events)."""
    return {
        str(record.get("worker"))
        for record in new_events(metrics, mark)
        if record.get("event") == "join"
    }


def wait_for_address(server: Child, metrics: Path, mark: EventsMark, timeout_s: float) -> str:
    """The server's address once its ``start`` event is written; fails fast with the server's
    error if it exits first.

    Raises:
        PSError: the server exited, or did not start within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        address = new_start_address(metrics, mark)
        if address is not None:
            return address
        if server.code is not None:
            raise PSError(f"the server did not start: {server.failure()}")
        if time.monotonic() > deadline:
            raise PSError(f"the server did not start listening within {timeout_s:g} s")
        time.sleep(POLL_S)


def _signal_group(popen: subprocess.Popen[str], signum: int) -> None:
    """Send ``signum`` to the child's process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signum)


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGTERM or SIGINT; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _on_signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT call ``handler`` (main thread only; elsewhere the
    block runs with the handlers as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGTERM and SIGINT raise ``Interrupted``, so the launcher stops its children in order."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    return _on_signals(interrupt)


def second_signal_kills(children: Children) -> contextlib.AbstractContextManager[None]:
    """While the children are being stopped, another SIGINT/SIGTERM kills them at once."""
    return _on_signals(lambda _signum, _frame: children.kill_groups())
