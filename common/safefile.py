"""Files written safely: a fresh temporary file that is never a link, a FIFO or an old file,
renamed into place; and writes whose time is bounded (a stalled disk cannot hang the caller)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class WriteTimeout(OSError):
    """A write did not finish in time; its thread was abandoned."""


def open_temporary(path: Path) -> IO[bytes]:
    """Open ``path`` as a new, empty file of this process.

    Whatever is at that name (a temporary file left by a crash, or a planted link or FIFO) is
    removed, never followed or opened; if something appears there again before the file is
    created, the open fails instead of writing through it.

    Args:
        path: the temporary file's name.

    Returns:
        The file, open for binary writing.

    Raises:
        OSError: it cannot be created.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.fdopen(os.open(path, _NEW_FILE, 0o644), "wb")


def write_atomic(path: Path, fill: Callable[[IO[bytes]], object], sync: bool = False) -> Path:
    """Write ``path`` through a temporary file beside it, then rename it into place, so a crash
    leaves the old file or the new one, never a torn one.

    Args:
        path: the file to write.
        fill: writes the content into the open temporary file.
        sync: fsync the file before the rename.

    Returns:
        ``path``.

    Raises:
        OSError: it could not be written (the temporary file is removed).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open_temporary(tmp) as handle:
            fill(handle)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


async def run_bounded(work: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """Run ``work`` (a blocking file write) on a thread of its own and wait at most ``timeout_s``.

    A thread blocked in the kernel cannot be stopped: after the timeout (or when the caller is
    cancelled, e.g. by the end of a shutdown budget) it is abandoned and logged as such (a write
    cancelled before its thread began is not run); a daemon thread never keeps the process alive.

    Args:
        work: the write.
        timeout_s: how long to wait for it.
        what: what is written, for the messages.

    Returns:
        What ``work`` returned.

    Raises:
        WriteTimeout: it did not finish within ``timeout_s``.
        Exception: whatever ``work`` raised.
    """
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()
    thread = threading.Thread(target=_run_into, args=(work, future), name=f"write: {what}")
    thread.daemon = True
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        log.error("abandoned a stuck write: %s did not finish within %g s", what, timeout_s)
        raise WriteTimeout(f"{what} did not finish within {timeout_s:g} s (abandoned)") from None
    except asyncio.CancelledError:
        if not future.done():
            log.error("abandoned a stuck write at shutdown: %s had not finished", what)
        raise


def _run_into(work: Callable[[], _T], future: concurrent.futures.Future[_T]) -> None:
    """Run ``work`` into ``future``, unless the future was cancelled before it started."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(work())
        except BaseException as exc:
            future.set_exception(exc)


class WriteThread:
    """One daemon thread that runs queued writes in order; a stuck write never blocks the
    process's exit (a thread pool's workers are joined at exit, so one stuck write would)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Queue ``work``; the future completes when it has run."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._jobs.put((work, future))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            _run_into(*job)

    def close(self, timeout_s: float | None = None) -> bool:
        """Let the queued writes finish for at most ``timeout_s`` (None: however long).

        Returns:
            True when they did; False when the thread is stuck and was abandoned.
        """
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
