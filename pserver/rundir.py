"""The run directory at start-up: refuse to mix runs, replace one on request, or pick the
checkpoint to resume from."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from common.errors import ConfigError
from pserver import checkpoint
from pserver.config import ServerConfig

log = logging.getLogger(__name__)

# What makes a directory hold a run (launcher logs and job scripts do not count).
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "snapshots", "snapshots.jsonl")


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
    if config.resume:
        return checkpoint.read_newest(run_dir / "checkpoints")
    present = run_files(run_dir)
    if present and not config.overwrite:
        raise ConfigError(
            f"--run-dir {run_dir} already holds a run ({', '.join(present)}); give --resume "
            "to continue it or --overwrite to replace it"
        )
    return None


def clear(config: ServerConfig) -> None:
    """With ``--overwrite``, remove the earlier run's files (call once every input of the new
    run has been checked and its sockets are bound, so a failed start keeps the old run)."""
    if config.run_dir is None or config.resume or not config.overwrite:
        return
    remove_run(config.run_dir)


def remove_run(run_dir: Path) -> None:
    """Remove the run files ``run_files`` finds in ``run_dir`` (``--overwrite``)."""
    present = run_files(run_dir)
    for name in present:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if present:
        log.info("--overwrite: removed %s from %s", ", ".join(present), run_dir)


def run_files(run_dir: Path) -> list[str]:
    """The files in ``run_dir`` that make it hold a run (empty: a new run may start there)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]
