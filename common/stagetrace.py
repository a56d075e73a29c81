"""Timestamps of a round's stages across processes, for profiling; off unless asked for.

When the environment variable ``PSERVER_STAGE_TRACE`` names a directory, every process that
marks a stage appends one JSON line per mark to ``DIR/<role>-<pid>.jsonl``:
``{"ev": NAME, "t": seconds, ...fields}`` with ``t`` from ``time.monotonic()`` (one clock for
every process of the machine, network namespaces included), so marks of a worker, a shard and
the coordinator line up. Without the variable ``mark`` returns at once.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

ENV = "PSERVER_STAGE_TRACE"
FLUSH_EVERY = 256

_lock = threading.Lock()
_sink: IO[str] | None = None
_pending = 0
_directory = os.environ.get(ENV, "")


def enabled() -> bool:
    """True when stage marks are written."""
    return bool(_directory)


def start(role: str) -> None:
    """Open this process's trace file (no-op when tracing is off or already started).

    Args:
        role: what the process is (``worker``, ``shard``, ``server``): the file's prefix.
    """
    global _sink
    if not _directory or _sink is not None:
        return
    folder = Path(_directory)
    folder.mkdir(parents=True, exist_ok=True)
    _sink = (folder / f"{role}-{os.getpid()}.jsonl").open("a", encoding="utf-8")
    atexit.register(_close)


def mark(event: str, **fields: Any) -> None:
    """Record that ``event`` happens now (no-op unless ``start`` opened a trace file).

    Args:
        event: the stage's name.
        fields: JSON-ready values that identify the round (task id, version, offset).
    """
    global _pending
    if _sink is None:
        return
    line = json.dumps({"ev": event, "t": time.monotonic(), **fields})
    with _lock:
        _sink.write(line + "\n")
        _pending += 1
        if _pending >= FLUSH_EVERY:
            _sink.flush()
            _pending = 0


def _close() -> None:
    global _sink
    with _lock:
        if _sink is not None:
            _sink.close()
            _sink = None
