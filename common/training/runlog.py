"""The run directory's ``metrics.jsonl`` and ``summary.json`` (docs/run-files.md)."""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from common.safefile import write_atomic

log = logging.getLogger(__name__)

# Events written to disk at once (launchers and users wait for them); others are buffered and
# flushed by ``flush`` (the server calls it twice a second) or at close.
IMMEDIATE = frozenset(
    {"start", "train_start", "eval", "epoch", "join", "leave", "checkpoint", "resume", "finish"}
)
Sink = Callable[[dict[str, Any]], None]
RECENT_EVENTS = 2000  # events kept in memory (``RunLog.events``); the file holds them all


class RunLog:
    """Appends timestamped events to ``metrics.jsonl`` and writes ``summary.json`` atomically.

    A failing write (full disk, removed directory) never raises into training: it is logged,
    kept in ``error`` and further events are not written; the server reports it at the end.
    Every event is also handed to each sink (``add_sink``); a run directory gets a
    TensorBoard sink (``common.training.tbsink``) unless ``tensorboard`` is False. Memory
    stays bounded however long the run: ``events`` holds the ``RECENT_EVENTS`` latest.

    Args:
        run_dir: the run directory, created if missing; None keeps events in memory only.
        resume_at: continue an earlier run's clock from this many seconds and append to its
            ``metrics.jsonl`` (None: a new run, a new file).
        tensorboard: write TensorBoard event files under ``run_dir/tensorboard``.
        open_now: create the files now; False waits for ``open`` (events recorded until then
            are written by it).
    """

    def __init__(
        self,
        run_dir: Path | None,
        resume_at: float | None = None,
        *,
        tensorboard: bool = True,
        open_now: bool = True,
    ) -> None:
        self.started = time.monotonic() - (resume_at or 0.0)
        self.run_dir = run_dir
        self._resumed, self._tensorboard = resume_at is not None, tensorboard
        self._file: IO[str] | None = None
        self._unwritten: list[dict[str, Any]] | None = [] if run_dir is not None else None
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_EVENTS)
        self.error = ""
        self._sinks: list[Sink] = []
        self._closers: list[Callable[[], None]] = []
        if open_now:
            self.open()

    def open(self) -> None:
        """Create the run directory's files (once; events recorded before are written then).

        A server opens its log only once its inputs are checked and its sockets bound, so a
        failed start leaves nothing in the run directory.
        """
        if self.run_dir is None or self._unwritten is None:
            return
        unwritten, self._unwritten = self._unwritten, None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        torn = self._resumed and _ends_mid_line(path)
        self._file = path.open("a" if self._resumed else "w", encoding="utf-8")
        if torn:  # a line cut short by a killed server: the next event starts a line of its own
            self._file.write("\n")
        if self._tensorboard:
            from common.training.tbsink import TensorBoardSink

            try:
                board = TensorBoardSink(self.run_dir, fresh=not self._resumed)
            except OSError as exc:  # e.g. a full disk: the run goes on without it
                log.error("TensorBoard files cannot be written (%s); going on without", exc)
            else:
                board.set_clock(self.now())
                self.add_sink(board, board.close)
                for record in unwritten:
                    board(record)
        for record in unwritten:
            self._write(record)
        self.flush()

    def add_sink(self, sink: Sink, close: Callable[[], None] | None = None) -> None:
        """Hand every later event to ``sink`` (it must not block); ``close`` runs on close."""
        self._sinks.append(sink)
        if close is not None:
            self._closers.append(close)

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.started

    def event(self, name: str, t: float | None = None, **fields: Any) -> dict[str, Any]:
        """Record one event; ``t`` defaults to now."""
        record = {"event": name, "t": round(self.now() if t is None else t, 6), **fields}
        self.events.append(record)
        if self._unwritten is not None:
            self._unwritten.append(record)
        self._write(record)
        for sink in self._sinks:
            sink(record)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(_json_line(record))
            if record["event"] in IMMEDIATE:
                self._file.flush()
        except (OSError, ValueError) as exc:
            self._failed(exc)

    def flush(self) -> None:
        """Write buffered events to disk."""
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.error = f"cannot write {self.run_dir}/metrics.jsonl: {exc}"
        log.error("%s; events are kept in memory only from now on", self.error)
        file, self._file = self._file, None
        try:
            if file is not None:
                file.close()
        except OSError:
            pass

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` via a new temporary file and rename.

        Raises:
            OSError: the file cannot be written (the temporary file is removed).
        """
        if self.run_dir is None:
            return
        text = (json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n").encode()
        write_atomic(self.run_dir / "summary.json", lambda handle: handle.write(text))

    def close(self) -> None:
        """Close the sinks (TensorBoard flushes), then flush and close ``metrics.jsonl``."""
        closers, self._closers, self._sinks = self._closers, [], []
        for close in closers:
            close()
        self.flush()
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._failed(exc)
            self._file = None


def _json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of JSON, NaN and infinities as null (only a record that has
    any is rebuilt with ``_finite``)."""
    try:
        return json.dumps(record, allow_nan=False) + "\n"
    except ValueError:
        return json.dumps(_finite(record), allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _ends_mid_line(path: Path) -> bool:
    """Whether the file at ``path`` exists and its last byte is not a newline."""
    try:
        with path.open("rb") as f:
            return f.seek(0, 2) > 0 and f.seek(-1, 2) >= 0 and f.read(1) != b"\n"
    except FileNotFoundError:
        return False
