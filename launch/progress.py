"""A live progress bar for a run, fed from the events its server writes to ``metrics.jsonl``.

The bar counts training samples applied (``round`` and ``push`` events); with ``--epochs`` its
total is epochs x training samples (from the ``start`` event), with only ``--max-steps`` it
counts updates. Its status shows the epoch, the model version and the latest test OA.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from common.training.tables import oa_text
from launch.procs import EventsMark, EventTail

POLL_S = 0.5  # how often the file is read for new events


def eval_label(record: dict[str, Any]) -> str:
    """How an eval event is named for the user: its version and the epochs done at it.

    Several evaluations may fall in one epoch (``--eval-every-updates``, or a late evaluation
    scoring a version made after the epoch's end), so the version identifies them;
    ``epochs_done`` (samples applied / training samples) places them, e.g. ``version 230
    (epoch 2.00)``. Events without it (the DDP baseline) show their epoch.
    """
    done = record.get("epochs_done")
    if isinstance(done, int | float):
        return f"version {record.get('version')} (epoch {done:.2f})"
    return f"epoch {record.get('epoch')} version {record.get('version')}"


class RunProgress:
    """The progress of one run, shown on a tqdm bar.

    Args:
        epochs: the run's ``--epochs`` (None: not given).
        max_steps: the run's ``--max-steps`` (None: not given).
        enabled: False shows nothing (the events are still read).
        file: where the bar goes (default: stderr).
    """

    def __init__(
        self,
        epochs: int | None,
        max_steps: int | None,
        *,
        enabled: bool = True,
        file: IO[str] | None = None,
    ) -> None:
        self.epochs, self.max_steps = epochs, max_steps
        self.by_steps = epochs is None and max_steps is not None
        self.samples = self.steps = self.version = self.epoch = 0
        self.oa: float | None = None
        self.last_eval: dict[str, Any] = {}
        self._lock = threading.Lock()  # the follower thread and the closing thread both feed
        self.bar = tqdm(
            total=max_steps if self.by_steps else None,
            unit="update" if self.by_steps else "sample",
            desc="training",
            disable=not enabled,
            file=file,
            dynamic_ncols=True,
        )
        self.bar.set_postfix_str("starting", refresh=False)

    def feed(self, record: dict[str, Any]) -> None:
        """Take one ``metrics.jsonl`` event into account (unknown events are ignored)."""
        kind = record.get("event")
        if kind == "start" and not self.by_steps and self.epochs is not None:
            train = record.get("train")
            if isinstance(train, int) and train > 0:
                self.bar.total = self.epochs * train
        elif kind in ("round", "push"):
            if kind == "round":
                batch = sum(_int(w.get("batch")) for w in record.get("workers") or ())
            else:
                batch = _int(record.get("batch"))
            self.samples += batch
            amount = 1 if self.by_steps else batch
            if self.steps == 0:  # the rate (and ETA) starts after the first update, not start-up
                self.bar.reset(total=self.bar.total)
                self.bar.initial = self.bar.n = self.bar.last_print_n = amount
            else:
                self.bar.update(amount)
            self.steps += 1
            self.version = _int(record.get("version")) or self.version
            self.epoch = _int(record.get("epoch")) or self.epoch
        elif kind == "resume" and isinstance(record.get("samples"), int):  # from a checkpoint
            self.samples = record["samples"]
            if not self.by_steps:
                self.bar.n = self.samples
        elif kind == "eval" and isinstance(record.get("oa"), int | float):
            self.oa, self.last_eval = float(record["oa"]), record
        else:
            return
        self.bar.set_postfix_str(self.status(), refresh=False)

    def status(self) -> str:
        """The bar's status text: epoch, model version and latest test OA."""
        return f"epoch {self.epoch}, version {self.version}, {oa_text(self.last_eval, 3)}"

    def close(self) -> None:
        """Close the bar (it stays on screen)."""
        self.bar.close()

    @contextlib.contextmanager
    def follow(self, metrics: Path, mark: EventsMark) -> Iterator[None]:
        """Within the block, feed the events a server writes to ``metrics`` after ``mark``.

        The file is read every ``POLL_S`` seconds on a thread; leaving the block reads what is
        left, stops the thread and closes the bar.
        """
        stop = threading.Event()
        tail = EventTail(metrics, mark)
        thread = threading.Thread(target=self._follow, args=(tail, stop), daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10.0)
            self._feed_all(tail)
            self.close()

    def _follow(self, tail: EventTail, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            self._feed_all(tail)

    def _feed_all(self, tail: EventTail) -> None:
        with self._lock:
            records = tail.read()
            for record in records:
                self.feed(record)
            if records:
                self.bar.refresh()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
