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

from common.training.perfmodel import finite
from common.training.rounds import breakdown, idle_share

log = logging.getLogger(__name__)

SUBDIR = "tensorboard"
EVENTS = frozenset({"eval", "round", "push"})
INTERVAL_S = 0.5
HANDOFF_S = 0.5  # wall seconds a round or push event may wait before the writer gets it
HANDOFF_MAX = 256  # events handed to the writer at once at most
SCORES = ("oa", "aa", "kappa", "loss")
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _tag(name: str) -> str:
    """A worker name made safe for a TensorBoard tag (no slashes, bounded length)."""
    return _TAG_UNSAFE.sub("_", name)[:64] or "_"


class _Window:
    """Round or push scalars gathered over a stretch of the run clock, written as one record."""

    def __init__(self, t: float) -> None:
        self.start = t
        self.t = t
        self.step = 0
        self.count: dict[str, int] = {}
        self.sums: dict[str, list[float]] = {}
        self.lasts: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def mean(self, tag: str, value: Any) -> None:
        number = finite(value)
        if number is not None:
            acc = self.sums.setdefault(tag, [0.0, 0.0])
            acc[0] += number
            acc[1] += 1

    def last(self, tag: str, value: Any) -> None:
        number = finite(value)
        if number is not None:
            self.lasts[tag] = number

    def most(self, tag: str, value: Any) -> None:
        number = finite(value)
        if number is not None:
            self.maxes[tag] = max(self.maxes.get(tag, number), number)

    def scalars(self) -> list[tuple[str, float]]:
        out = [(tag, float(n)) for tag, n in self.count.items()]
        out += [(tag, total / n) for tag, (total, n) in self.sums.items()]
        return out + list(self.lasts.items()) + list(self.maxes.items())


class TensorBoardSink:
    """Turns run-log events into TensorBoard scalars under ``RUN_DIR/tensorboard``.

    Call it with each event (``RunLog`` does); it only queues the event, so the caller (the
    server's event loop) never waits for a file write. Events are handed over in batches (an
    evaluation at once; rounds and pushes with the first event ``HANDOFF_S`` of wall time after
    the oldest waiting one, or once ``HANDOFF_MAX`` wait, and at ``close()``), so the writer
    thread does not wake, and contend for the interpreter, on every round. A thread of its
    own converts and writes them; ``close()`` drains the queue and flushes. TensorBoard's
    writer checksums every record in pure Python, so scalars are packed: one record per
    evaluation, and one per ``interval_s`` of run time for rounds and pushes (hundreds per
    second in small runs):

    - ``eval/{oa,aa,kappa,loss}`` per evaluation (step: samples seen);
    - ``round/{seconds,idle_share}`` (means over the interval), ``round/count`` (rounds in
      it), per worker ``worker/NAME/{batch_share,idle_share}`` (means) and ``speed`` (last);
    - ``push/staleness`` (mean), ``push/staleness_max``, ``push/count``, per worker
      ``worker/NAME/staleness`` (mean), ``speed`` (last), ``batch_share`` (its share of all
      samples pushed so far); round and push steps are the server version.

    Wall times are the run's start plus the event's ``t``, so TensorBoard's "relative" axis is
    the run clock; ``metrics.jsonl`` keeps every round and push.

    Args:
        run_dir: the run directory; event files go to ``run_dir/tensorboard``.
        fresh: remove event files left there by an earlier run (a new run, not a resume).
        max_queue: batches kept waiting at most; further ones are dropped (their events
            counted).
        interval_s: run-clock seconds gathered into one round or push record.
    """

    def __init__(
        self,
        run_dir: Path,
        fresh: bool = True,
        *,
        max_queue: int = 10000,
        interval_s: float = INTERVAL_S,
    ) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # heavy imports: only here
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / SUBDIR
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in self.log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self._writer = SummaryWriter(str(self.log_dir), max_queue=100, flush_secs=10)
        self._summary = Summary
        self.interval_s = interval_s
        self._window: _Window | None = None
        self._queue: queue.Queue[list[Mapping[str, Any]] | None] = queue.Queue(max_queue)
        self._batch: list[Mapping[str, Any]] = []
        self._batch_since = 0.0
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
        now = time.monotonic()
        if not self._batch:
            self._batch_since = now
        self._batch.append(record)
        if (
            record.get("event") == "eval"
            or len(self._batch) >= HANDOFF_MAX
            or now - self._batch_since >= HANDOFF_S
        ):
            self._hand_off()

    def _hand_off(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            if not self.dropped:
                log.warning("TensorBoard writer is behind; dropping events")
            self.dropped += len(batch)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, flush and close the event file (bounded by ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._hand_off()
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("TensorBoard writer did not drain in %.0f s", timeout_s)
            return
        self._thread.join(max(deadline - time.monotonic(), 0.1))
        if self._thread.is_alive():
            log.warning("TensorBoard writer did not finish in %.0f s", timeout_s)

    # --- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (batch := self._queue.get()) is not None:
                for record in batch:
                    try:
                        self._write(record)
                    except Exception:  # one odd record must not end the sink
                        log.exception("TensorBoard: cannot write %s", record.get("event"))
            self._flush_window()
        finally:
            try:
                self._writer.close()
            except OSError as exc:  # a full disk must not end the process with a traceback
                log.error("TensorBoard: cannot close the event file: %s", exc)

    def _emit(self, scalars: list[tuple[str, float]], step: int, t: float) -> None:
        """Write scalars as one record."""
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in scalars]
        if values:
            summary = self._summary(value=values)
            file_writer = self._writer.file_writer
            assert file_writer is not None  # SummaryWriter opens it in __init__
            file_writer.add_summary(summary, step, walltime=self._wall0 + t)

    def _flush_window(self) -> None:
        window, self._window = self._window, None
        if window is not None:
            self._emit(window.scalars(), window.step, window.t)

    def _write(self, record: Mapping[str, Any]) -> None:
        kind, t = record["event"], finite(record.get("t")) or 0.0
        if kind == "eval":
            scores = [(f"eval/{k}", finite(record.get(k))) for k in SCORES]
            step = int(finite(record.get("samples")) or finite(record.get("version")) or 0)
            self._emit([(tag, v) for tag, v in scores if v is not None], step, t)
            self._writer.flush()  # evaluations are rare and the ones people watch
            return
        if self._window is not None and t - self._window.start >= self.interval_s:
            self._flush_window()
        if self._window is None:
            self._window = _Window(t)
        window = self._window
        window.t = t
        window.step = int(finite(record.get("version")) or window.step)
        if kind == "round":
            self._round(window, record)
        else:
            self._push(window, record)

    def _round(self, window: _Window, record: Mapping[str, Any]) -> None:
        parts = breakdown(record)
        round_s = finite(record.get("round_s"))
        if not parts or not round_s:
            return
        window.count["round/count"] = window.count.get("round/count", 0) + 1
        window.mean("round/seconds", round_s)
        window.mean("round/idle_share", idle_share(parts, round_s))
        for part in parts:
            name = _tag(part.worker)
            window.last(f"worker/{name}/speed", part.speed)
            window.mean(f"worker/{name}/batch_share", part.share)
            window.mean(f"worker/{name}/idle_share", part.idle_s / round_s)

    def _push(self, window: _Window, record: Mapping[str, Any]) -> None:
        worker = str(record.get("worker", "?"))
        name = _tag(worker)
        batch = int(finite(record.get("batch")) or 0)
        self._samples[worker] = self._samples.get(worker, 0) + batch
        total = sum(self._samples.values())
        window.count["push/count"] = window.count.get("push/count", 0) + 1
        window.mean("push/staleness", record.get("staleness"))
        window.most("push/staleness_max", record.get("staleness"))
        window.mean(f"worker/{name}/staleness", record.get("staleness"))
        window.last(f"worker/{name}/speed", record.get("speed"))
        if total:
            for other, samples in self._samples.items():
                window.last(f"worker/{_tag(other)}/batch_share", samples / total)
