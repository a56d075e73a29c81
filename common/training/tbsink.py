"""TensorBoard event files from run-log events, written off the caller's thread."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.training.rounds import breakdown, idle_share

log = logging.getLogger(__name__)

SUBDIR = "tensorboard"
EVENTS = frozenset({"eval", "round", "push"})
SCORES = ("oa", "aa", "kappa", "loss")
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _tag(name: str) -> str:
    """A worker name made safe for a TensorBoard tag (no slashes, bounded length)."""
    return _TAG_UNSAFE.sub("_", name)[:64] or "_"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


class TensorBoardSink:
    """Turns run-log events into TensorBoard scalars under ``RUN_DIR/tensorboard``.

    Call it with each event (``RunLog`` does); it only queues the event, so the caller (the
    server's event loop) never waits for a file write. A thread of its own converts and writes
    them, all scalars of one event as one record (TensorBoard's writer checksums each record
    in pure Python, so one record per scalar would cost ten times as much); ``close()``
    drains the queue and flushes. Scalars: ``eval/{oa,aa,kappa,loss}`` per
    evaluation (step: samples seen), ``round/seconds`` and ``round/idle_share`` per sync round,
    ``push/staleness`` per async push (step: version), and per worker
    ``worker/NAME/{speed,batch_share,idle_share,staleness}``. Wall times are the run's start
    plus the event's ``t``, so TensorBoard's "relative" axis is the run clock.

    Args:
        run_dir: the run directory; event files go to ``run_dir/tensorboard``.
        fresh: remove event files left there by an earlier run (a new run, not a resume).
        max_queue: events kept waiting at most; further ones are dropped and counted.
    """

    def __init__(self, run_dir: Path, fresh: bool = True, max_queue: int = 10000) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # heavy imports: only here
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / SUBDIR
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in self.log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self._writer = SummaryWriter(str(self.log_dir), max_queue=100, flush_secs=10)
        self._summary = Summary
        self._pending: list[Any] = []
        self._queue: queue.Queue[Mapping[str, Any] | None] = queue.Queue(max_queue)
        self._wall0 = time.time()
        self._samples: dict[str, int] = {}
        self.dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tensorboard", daemon=True)
        self._thread.start()

    def set_clock(self, seconds_since_start: float) -> None:
        """Align wall times with the run clock (``RunLog.now()`` at this moment)."""
        self._wall0 = time.time() - seconds_since_start

    def __call__(self, record: Mapping[str, Any]) -> None:
        """Queue ``record`` if it carries scalars; never blocks."""
        if self._closed or record.get("event") not in EVENTS:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            if not self.dropped:
                log.warning("TensorBoard writer is behind; dropping events")
            self.dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the event file (bounded by ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._queue.put(None, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    log.warning("TensorBoard writer did not drain in %.0f s", timeout_s)
                    return
        self._thread.join(max(deadline - time.monotonic(), 0.1))
        if self._thread.is_alive():
            log.warning("TensorBoard writer did not finish in %.0f s", timeout_s)

    # --- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (record := self._queue.get()) is not None:
                try:
                    self._write(record)
                except Exception:  # one odd record must not end the sink
                    self._pending = []
                    log.exception("TensorBoard: cannot write %s", record.get("event"))
        finally:
            self._writer.close()

    def _scalar(self, tag: str, value: Any) -> None:
        """Add one scalar to the record being built (skipped when not a finite number)."""
        number = _finite(value)
        if number is not None:
            self._pending.append(self._summary.Value(tag=tag, simple_value=number))

    def _emit(self, step: int, t: float) -> None:
        """Write the scalars gathered for one event as one record."""
        if self._pending:
            summary = self._summary(value=self._pending)
            self._writer.file_writer.add_summary(summary, step, walltime=self._wall0 + t)
            self._pending = []

    def _write(self, record: Mapping[str, Any]) -> None:
        kind, t = record["event"], float(record.get("t", 0.0))
        if kind == "eval":
            step = int(record.get("samples", record.get("version", 0)))
            for key in SCORES:
                self._scalar(f"eval/{key}", record.get(key))
            self._emit(step, t)
            self._writer.flush()  # evaluations are rare and the ones people watch
        elif kind == "round":
            self._round(record)
            self._emit(int(record.get("version", record.get("round", 0))), t)
        elif kind == "push":
            self._push(record)
            self._emit(int(record.get("version", 0)), t)

    def _round(self, record: Mapping[str, Any]) -> None:
        round_s = _finite(record.get("round_s"))
        self._scalar("round/seconds", round_s)
        parts = breakdown(record)
        if round_s:
            self._scalar("round/idle_share", idle_share(parts, round_s))
        for part in parts:
            name = _tag(part.worker)
            self._scalar(f"worker/{name}/speed", part.speed)
            self._scalar(f"worker/{name}/batch_share", part.share)
            if round_s:
                self._scalar(f"worker/{name}/idle_share", part.idle_s / round_s)

    def _push(self, record: Mapping[str, Any]) -> None:
        worker = str(record.get("worker", "?"))
        name = _tag(worker)
        batch = int(_finite(record.get("batch")) or 0)
        self._samples[worker] = self._samples.get(worker, 0) + batch
        total = sum(self._samples.values())
        self._scalar("push/staleness", record.get("staleness"))
        self._scalar(f"worker/{name}/staleness", record.get("staleness"))
        self._scalar(f"worker/{name}/speed", record.get("speed"))
        if total:
            self._scalar(f"worker/{name}/batch_share", self._samples[worker] / total)
