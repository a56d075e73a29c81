"""What a run has done so far, apart from the parameters: its phase and why training ended,
clocks, evaluations, epochs.

The summary, the status view and the checkpoints read this, not the server.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from common.protocol.ending import FinishReason


class RunPhase(enum.Enum):
    """Where a run is in its life; it only moves forward."""

    WAITING = "waiting"  # for enough ready workers
    TRAINING = "training"
    ENDING = "ending"  # training ended: final checkpoint, evaluation, stopping workers, summary
    DONE = "done"  # the summary is written


@dataclasses.dataclass
class RunState:
    """A run's progress record and lifecycle.

    Attributes:
        phase: where the run is.
        reason: why training ended (None while it runs).
        stores_lost: a parameter shard is gone (no final checkpoint or evaluation then).
        error: what went wrong, when the run failed (the server then exits non-zero): what
            ended training when ``reason`` is ``FAILED``, else a failure of the end itself.
        train_start: run-clock time training started (None before).
        train_end: run-clock time training ended (None while it runs).
        evals: every ``eval`` record, in the order they were logged.
        epochs_done: the highest epoch completed.
        time_to_target: training time when a version first reached ``--target-oa``.
    """

    phase: RunPhase = RunPhase.WAITING
    reason: FinishReason | None = None
    stores_lost: bool = False
    error: str = ""
    train_start: float | None = None
    train_end: float | None = None
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    epochs_done: int = 0
    time_to_target: float | None = None
    _trained: bool = dataclasses.field(default=False, repr=False)

    @property
    def finished(self) -> bool:
        """Training has ended."""
        return self.reason is not None

    @property
    def training(self) -> bool:
        """Training has started and not ended."""
        return self.phase is RunPhase.TRAINING

    @property
    def started(self) -> bool:
        """Training has started in this server (it may have ended since)."""
        return self._trained

    @property
    def finish_reason(self) -> str:
        """Why training ended, as the ``finish`` event and the summary say it ("" while it runs):
        ``epochs``, ``max_steps``, ``target_oa``, ``stopped`` or ``failed: <what>``."""
        if self.reason is None:
            return ""
        if self.reason is FinishReason.FAILED:
            return f"failed: {self.error}"
        return self.reason.value

    @property
    def failed(self) -> str | None:
        """What went wrong, when a failure ended training (None otherwise)."""
        return self.error if self.reason is FinishReason.FAILED else None

    def start_training(self, t: float) -> None:
        """Training starts now (run-clock ``t``; a resumed run keeps its first start)."""
        if self.phase is RunPhase.WAITING:
            self.phase = RunPhase.TRAINING
        self._trained = True
        if self.train_start is None:
            self.train_start = t

    def finish(self, reason: FinishReason, t: float) -> bool:
        """Training ends now (run-clock ``t``).

        Returns:
            False if it had ended already (nothing changes then).
        """
        if self.finished:
            return False
        self.reason = reason
        self.train_end = t
        self.phase = RunPhase.ENDING
        return True

    def fail(self, failure: str, stores_lost: bool = False) -> None:
        """Record an error that ends the run (the first one is kept)."""
        self.stores_lost = self.stores_lost or stores_lost
        self.error = self.error or failure

    def train_time(self, t: float) -> float:
        """Training time at run-clock time ``t``."""
        if self.train_start is None:
            return 0.0
        end = t if self.train_end is None else min(t, self.train_end)
        return max(end - self.train_start, 0.0)

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
        reason = {r.value: r for r in FinishReason}.get(meta.get("finish_reason", ""))
        if reason is not None and reason.completed:
            self.reason = reason
            self.phase = RunPhase.ENDING
