"""Benchmark children: ``common.procs.Child`` run from the project root, output in a log file."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import ROOT
from common.procs import Child


def start(
    name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
) -> Child:
    """Start ``argv`` in its own session, unbuffered, with the project importable.

    Args:
        name: a label for logs and errors.
        argv: the command line (e.g. ``Host.argv([...])`` to run it inside a namespace).
        log_path: receives the merged stdout and stderr.
        env: extra environment variables.

    Returns:
        The running child.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return Child(name, argv, env=full_env, cwd=ROOT, log_path=log_path)


def python(module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
