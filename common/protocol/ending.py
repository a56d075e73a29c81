"""Why a run ended: the one list of reasons, and the worker's ``RunEnded``."""

from __future__ import annotations

import enum

from common.errors import PSError


class FinishReason(enum.Enum):
    """Why training ended; its value is the ``finish`` event's, the summary's and the wire's."""

    EPOCHS = "epochs"
    MAX_STEPS = "max_steps"
    TARGET_OA = "target_oa"
    STOPPED = "stopped"  # a signal or ``request_stop`` stopped the server
    INTERRUPTED = "interrupted"  # a signal stopped a DDP group, every rank after the same step
    FAILED = "failed"  # an error; the run's ``failure`` says which

    @property
    def completed(self) -> bool:
        """The run reached its end (a resume does not train on)."""
        return self in (FinishReason.EPOCHS, FinishReason.MAX_STEPS, FinishReason.TARGET_OA)

    @property
    def words(self) -> str:
        """What a worker's last line says, e.g. ``server interrupted (Ctrl-C or SIGTERM)``."""
        return _WORDS[self]


_WORDS = {
    FinishReason.EPOCHS: "run finished (all epochs done)",
    FinishReason.MAX_STEPS: "run finished (--max-steps reached)",
    FinishReason.TARGET_OA: "run finished (--target-oa reached)",
    FinishReason.STOPPED: "server interrupted (Ctrl-C or SIGTERM)",
    FinishReason.INTERRUPTED: "run interrupted (Ctrl-C or SIGTERM)",
    FinishReason.FAILED: "run failed",
}


class RunEnded(PSError):
    """The server ended training: a stop reply or heartbeats said so.

    Attributes:
        reason: why.
        failure: what went wrong, when a failure ended the run (else None).
    """

    def __init__(self, reason: FinishReason, failure: str | None = None) -> None:
        text = f"the server stopped the run: {failure}" if failure else "training has ended"
        super().__init__(text)
        self.reason, self.failure = reason, failure
