"""The multi-host benches: emulated hosts (network namespaces) with capped links."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from bench import ROOT
from common.procs import Child


def start(
    name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
) -> Child:
    """Start ``argv`` (e.g. ``Host.argv([...])`` to run it inside a namespace) in its own
    session, unbuffered, from the project root with the project importable, ``env`` added to
    this process's environment; ``log_path`` receives its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return Child(name, argv, env=full_env, cwd=ROOT, log_path=log_path)
