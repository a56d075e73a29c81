"""Training hyperparameters shared by parameter-server runs and the DDP baseline."""

from __future__ import annotations

from pserver.config import TrainSettings

__all__ = ["TrainSettings", "server_mode_args"]


def server_mode_args(staleness: str | None, max_staleness: int | None) -> tuple[str, ...]:
    """``pserver start`` options for the async settings given (none for server defaults)."""
    args: list[str] = []
    if staleness is not None:
        args += ["--staleness", staleness]
    if max_staleness is not None:
        args += ["--max-staleness", str(max_staleness)]
    return tuple(args)
