"""What a run has done so far, apart from the parameters: clocks, evaluations, epochs, the end.

The summary and the checkpoints read this, not the server.
"""

from __future__ import annotations

import dataclasses
from typing import Any

COMPLETED = ("epochs", "max_steps", "target_oa")  # finish reasons of a run that reached its end


@dataclasses.dataclass
class RunState:
    """A run's progress record.

    Attributes:
        train_start: run-clock time training started (None before).
        train_end: run-clock time training ended (None while it runs).
        eval_s: evaluation time that blocked training (always 0 on the server, where
            evaluation runs beside training).
        evals: every ``eval`` record, in the order they were logged.
        epochs_done: the highest epoch completed.
        time_to_target: training time when a version first reached ``--target-oa``.
        finish_reason: why training ended (``epochs``, ``max_steps``, ``target_oa``,
            ``stopped``, ``failed: ...``), empty while it runs.
        error: set when the run failed; the server then exits non-zero.
    """

    train_start: float | None = None
    train_end: float | None = None
    eval_s: float = 0.0
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    epochs_done: int = 0
    time_to_target: float | None = None
    finish_reason: str = ""
    error: str = ""

    @property
    def finished(self) -> bool:
        """Training has ended."""
        return bool(self.finish_reason)

    @property
    def reply_reason(self) -> str | None:
        """The finish reason as stop and heartbeat replies carry it: without a failure's text
        (``failed: ...`` -> ``failed``; the ``failure`` field says it), None while training runs."""
        return self.finish_reason.partition(":")[0] or None

    def train_time(self, t: float) -> float:
        """Training time at run-clock time ``t``."""
        if self.train_start is None:
            return 0.0
        end = t if self.train_end is None else min(t, self.train_end)
        return max(end - self.train_start - self.eval_s, 0.0)

    def to_meta(self) -> dict[str, Any]:
        """JSON-able fields for a checkpoint."""
        return {
            "train_start": self.train_start,
            "time_to_target": self.time_to_target,
            "epochs_done": self.epochs_done,
            "evals": self.evals,
            "finish_reason": self.finish_reason,
        }

    def load_meta(self, meta: dict[str, Any]) -> None:
        """Restore what ``to_meta`` saved."""
        self.train_start = meta["train_start"]
        self.time_to_target = meta["time_to_target"]
        self.epochs_done = meta["epochs_done"]
        self.evals = list(meta["evals"])
        # A run stopped by a signal (scancel, a Slurm time limit) or by a failure goes on when
        # resumed; only a run that reached its end (epochs, steps, target) stays ended.
        reason = meta.get("finish_reason", "")
        self.finish_reason = reason if reason in COMPLETED else ""
