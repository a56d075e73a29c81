"""How a worker says why its training ended, from the ``finish_reason`` of the server's stop
(or heartbeat) reply."""

from __future__ import annotations

ENDINGS = {
    "epochs": "run finished (all epochs done)",
    "max_steps": "run finished (--max-steps reached)",
    "target_oa": "run finished (--target-oa reached)",
    "stopped": "server interrupted (Ctrl-C or SIGTERM)",
    "failed": "run failed",
}


def describe_end(finish_reason: str | None) -> str:
    """The words a worker's last line starts with.

    Args:
        finish_reason: as the server sent it (``FINISH_REASONS``); None when it did not say
            (an older server).

    Returns:
        E.g. ``"server interrupted (Ctrl-C or SIGTERM)"`` or ``"run finished (all epochs
        done)"``; a reason this worker does not know is quoted (printable characters only).
    """
    if finish_reason is None:
        return "stopped by the server (it did not say why)"
    known = ENDINGS.get(finish_reason)
    if known is not None:
        return known
    shown = "".join(c for c in finish_reason[:40] if c.isprintable())
    return f"run ended ({shown})"
