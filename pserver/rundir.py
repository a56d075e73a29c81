"""The run directory at start-up: refuse to mix runs, replace one on request, or pick the
checkpoint to resume from (the rule is ``common.rundir``'s, shared with the launchers)."""

from __future__ import annotations

import logging

from common import rundir
from pserver import checkpoint
from pserver.config import ServerConfig

log = logging.getLogger(__name__)


def prepare(config: ServerConfig) -> checkpoint.Checkpoint | None:
    """Check ``--run-dir`` against ``--resume``/``--overwrite`` without changing it (``clear``
    replaces an earlier run once the server has started).

    Returns:
        The checkpoint to resume from, or None for a new run.

    Raises:
        ConfigError: the directory holds another run (and neither option was given), or
            ``--resume`` finds no readable checkpoint.
    """
    run_dir = config.run_dir
    if run_dir is None:
        return None
    removed = checkpoint.remove_stale_tmp(run_dir / "checkpoints")
    if removed:
        log.warning("removed %d unfinished checkpoint files", removed)
    rundir.check(run_dir, resume=config.resume, overwrite=config.overwrite)
    return checkpoint.read_newest(run_dir / "checkpoints") if config.resume else None


def clear(config: ServerConfig) -> None:
    """Remove an earlier run's files (``--overwrite``) or what a failed start left; call once
    every input of the new run has been checked and its sockets are bound, so a failed start
    keeps the old run."""
    if config.run_dir is None or config.resume:
        return
    removed = rundir.clear(config.run_dir)
    if removed:
        log.info("removed %s from %s", ", ".join(removed), config.run_dir)
