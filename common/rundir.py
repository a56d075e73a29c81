"""The one rule for run folders, in every launcher: a folder holds a run once an update was
applied there; ``--resume`` continues it, ``--overwrite`` replaces it, and a start without
either is refused before anything is written. What a failed start leaves (a ``start`` event,
a summary of 0 steps) is no run: the corrected start replaces it."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from common.errors import ConfigError

# What a run writes into its folder (launcher logs and job scripts do not count).
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "snapshots", "snapshots.jsonl")
UPDATES = ("round", "push")  # metrics.jsonl events that say an update was applied


def run_files(folder: Path) -> list[str]:
    """The names of ``RUN_FILES`` present in ``folder``."""
    return [name for name in RUN_FILES if (folder / name).exists()]


def started(folder: Path) -> bool:
    """Whether ``folder`` holds a run that applied an update (a checkpoint, a snapshot, a
    ``round`` or ``push`` event, or a summary of more than 0 steps; an unreadable summary
    counts as a run)."""
    if any(any((folder / d).glob("*.npz")) for d in ("checkpoints", "snapshots")):
        return True
    summary = folder / "summary.json"
    if summary.exists():
        try:
            if json.loads(summary.read_text(encoding="utf-8")).get("steps") != 0:
                return True
        except (OSError, ValueError, AttributeError):
            return True
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():  # also a FIFO or a device at that name: never opened
        return False
    with metrics.open("rb") as lines:
        for line in lines:
            with contextlib.suppress(ValueError, AttributeError):
                if json.loads(line).get("event") in UPDATES:
                    return True
    return False


def check(folder: Path, *, resume: bool, overwrite: bool, option: str = "--run-dir") -> None:
    """Refuse a start into ``folder`` that would mix runs; changes nothing.

    Args:
        folder: the run folder.
        resume, overwrite: the launcher's ``--resume`` and ``--overwrite``.
        option: the option that named the folder, for the message.

    Raises:
        ConfigError: both options, or the folder holds a run and neither was given.
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if not (resume or overwrite) and started(folder):
        raise ConfigError(
            f"{option} {folder} already holds a run ({', '.join(run_files(folder))}); give "
            "--resume to continue it or --overwrite to replace it"
        )


def clear(folder: Path) -> list[str]:
    """Remove the run files in ``folder`` (an earlier run, or what a failed start left).

    Returns:
        The names removed.
    """
    present = run_files(folder)
    for name in present:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return present
