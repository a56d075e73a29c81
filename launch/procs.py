"""A server's readiness, the events it writes and a launcher's signals.

A server is ready once its ``start`` event, which carries the address it listens on, is in the
run's ``metrics.jsonl``; launchers, benchmarks and tests all wait for that event. Launchers run
their children (``common.procs.Children``) in their own sessions, so a Ctrl-C in the terminal
reaches only the launcher, which then asks the server to stop once (a second signal would make
the server exit at once and lose its summary); whatever outlives its grace period is killed
with its whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import IO, Any

from common.errors import NetworkTimeout, PSError, WaitTimeout
from common.polling import poll_until
from common.procs import Child, Children

POLL_S = 0.2


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

    def offset(self, stat: os.stat_result) -> int:
        """Where the new events begin in the file whose ``stat`` is given: 0 unless it is the
        file that was there, and 0 also when that file was truncated."""
        if self._old is None:
            return 0
        old = os.fstat(self._old.fileno())
        same = (old.st_dev, old.st_ino) == (stat.st_dev, stat.st_ino)
        return self.size if same and stat.st_size >= self.size else 0

    def close(self) -> None:
        """Let go of the old file."""
        if self._old is not None:
            self._old.close()
            self._old = None


def _offset(mark: EventsMark | int, stat: os.stat_result) -> int:
    return mark if isinstance(mark, int) else mark.offset(stat)


class EventTail:
    """The complete JSON lines a server appended to a file since the last read; a file that
    replaces the one read so far is read from its start.

    Args:
        path: the run's ``metrics.jsonl``.
        mark: where this launch's events begin: an ``EventsMark`` taken before the server
            started, or a byte offset (for a process that did not start the server; it
            cannot tell a replaced file).
    """

    def __init__(self, path: Path, mark: EventsMark | int) -> None:
        self.path, self.mark = path, mark
        self.offset = 0
        self.file_id: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        """The events appended since the last call, in order."""
        with self._lock:
            try:
                with self.path.open("rb") as f:
                    stat = os.fstat(f.fileno())
                    if (stat.st_dev, stat.st_ino) != self.file_id:
                        first = self.file_id is None
                        self.file_id = (stat.st_dev, stat.st_ino)
                        self.offset = _offset(self.mark, stat) if first else 0
                    f.seek(self.offset)
                    data = f.read()
            except FileNotFoundError:
                return []
            end = data.rfind(b"\n") + 1  # a last line without its newline is still being written
            self.offset += end
        records = []
        for line in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records


def new_events(metrics: Path, mark: EventsMark | int) -> list[dict[str, Any]]:
    """The complete events written to ``metrics`` after ``mark`` (none while the file does not
    exist); ``mark`` as for ``EventTail``."""
    return EventTail(metrics, mark).read()


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


def wait_for_start(
    metrics: Path, mark: EventsMark | int, timeout_s: float, gone: Callable[[], str | None]
) -> str:
    """The address of the server's ``start`` event, the one readiness signal of a server: it is
    written once the server listens, into the run's ``metrics.jsonl``.

    Args:
        metrics: the run's ``metrics.jsonl``.
        mark: where the new server's events begin (see ``new_events``).
        timeout_s: how long to wait.
        gone: None while the server runs, else why it is not running (asked between reads).

    Returns:
        The address workers connect to.

    Raises:
        PSError: ``gone`` said the server is not running.
        NetworkTimeout: no ``start`` event within ``timeout_s``.
    """

    def address() -> str | None:
        found = new_start_address(metrics, mark)
        if found is None and (why := gone()) is not None:
            raise PSError(why)
        return found

    try:
        return poll_until(address, timeout_s, POLL_S, "the server's start event")
    except WaitTimeout as exc:
        raise NetworkTimeout(f"the server did not listen within {timeout_s:g} s") from exc


def wait_for_address(server: Child, metrics: Path, mark: EventsMark, timeout_s: float) -> str:
    """The address of ``server`` (a child of this process) once its ``start`` event is written;
    fails fast with the server's error if it exits first.

    Raises:
        PSError: the server exited.
        NetworkTimeout: it did not start within ``timeout_s``.
    """

    def gone() -> str | None:
        return None if server.code is None else f"the server did not start: {server.failure()}"

    return wait_for_start(metrics, mark, timeout_s, gone)


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
