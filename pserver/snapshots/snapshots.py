"""Parameter snapshots at a fixed interval of updates, kept for evaluation after training.

``--snapshot-every-updates N`` saves the flat state of every N-th version under
``RUN_DIR/snapshots/`` as ``snap-<version>.npz``: a float32 ``state`` array and a ``meta``
array holding JSON bytes (version, epoch, samples applied, training time when the version was
made). No pickle: files load with ``np.load(allow_pickle=False)`` and every field is checked.
``snapshots/run.json`` names the model, the dataset and its fingerprint. Disk use is bounded:
when more than ``--snapshot-limit`` snapshots exist, every other one is deleted and the
interval doubles, so at most ``limit`` x state bytes stay on disk. A snapshot is not written
when the disk would then keep less free space than a checkpoint of the state needs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import math
import re
import shutil
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ConfigError
from common.regular_files import open_regular, read_npz
from common.safefile import WriteThread, write_atomic
from pserver.errorlog import RateLimitedLog

log = logging.getLogger(__name__)

DIRECTORY = "snapshots"
RUN_FILE = "run.json"
FORMAT = 1
KIND = "rs-pserver-snapshot"
NAME = re.compile(r"^snap-(\d{10})\.npz$")
MAX_META_BYTES = 64 << 10
NPY_HEADER_BYTES = 4096  # generous bound on an .npy header inside the archive
MAX_PENDING = 8  # snapshot writes queued before the server warns
CHECKPOINT_COPIES = 3  # a checkpoint holds the state and up to two optimizer slots

Fetch = Callable[[], Awaitable[tuple[int, np.ndarray, Callable[[], None]]]]


class SnapshotError(ConfigError):
    """A snapshot file or the snapshot directory is missing, damaged or inconsistent."""


@dataclasses.dataclass(frozen=True)
class SnapshotMeta:
    """When and where a snapshot's version was made."""

    version: int
    epoch: int
    samples: int
    train_time_s: float
    final: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON document stored in the file."""
        return {"format": FORMAT, "kind": KIND, **dataclasses.asdict(self)}


def path_for(directory: Path, version: int) -> Path:
    """Where the snapshot of ``version`` lives."""
    return directory / f"snap-{version:010d}.npz"


def write(directory: Path, state: np.ndarray, meta: SnapshotMeta) -> Path:
    """Write one snapshot atomically (a new temporary file, then rename).

    Raises:
        OSError: it could not be written (no temporary file is left behind).
    """
    document = np.frombuffer(json.dumps(meta.to_json()).encode(), dtype=np.uint8)
    state = np.asarray(state, dtype=np.float32)
    return write_atomic(
        path_for(directory, meta.version),
        lambda handle: np.savez(handle, state=state, meta=document),
    )


def list_snapshots(directory: Path) -> list[tuple[int, Path]]:
    """(version, path) of every snapshot file in ``directory``, by version."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def _bad(path: Path, why: str) -> SnapshotError:
    return SnapshotError(f"snapshot {path.name} is damaged: {why}")


def _int_field(meta: dict[str, Any], key: str, path: Path) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(path, f"{key} must be an integer >= 0, got {str(value)[:40]!r}")
    return value


def _check_meta(document: Any, path: Path) -> SnapshotMeta:
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise _bad(path, "not a snapshot of this project")
    if document.get("format") != FORMAT:
        raise _bad(path, f"unknown format {str(document.get('format'))[:20]!r}")
    train = document.get("train_time_s")
    if not isinstance(train, int | float) or isinstance(train, bool) or not math.isfinite(train):
        raise _bad(path, f"train_time_s must be a finite number, got {str(train)[:40]!r}")
    if train < 0:
        raise _bad(path, f"train_time_s must be >= 0, got {train}")
    meta = SnapshotMeta(
        version=_int_field(document, "version", path),
        epoch=_int_field(document, "epoch", path),
        samples=_int_field(document, "samples", path),
        train_time_s=float(train),
        final=bool(document.get("final", False)),
    )
    match = NAME.match(path.name)
    if match and int(match.group(1)) != meta.version:
        raise _bad(path, f"it holds version {meta.version}, its name another")
    return meta


def read(path: Path, state_size: int, with_state: bool = True) -> tuple[SnapshotMeta, np.ndarray]:
    """Read and check one snapshot (sizes are checked before anything is loaded).

    Args:
        path: the snapshot file.
        state_size: values the run's state holds.
        with_state: also load the state (else an empty array is returned).

    Returns:
        Its metadata and its float32 state.

    Raises:
        SnapshotError: the file is unreadable, has unexpected members or sizes, bad
            metadata, or a state that is not finite float32 of ``state_size`` values.
    """
    limits = {"meta": MAX_META_BYTES, "state": state_size * 4}
    largest = sum(limits.values()) + 4 * NPY_HEADER_BYTES  # and the archive's directory
    try:
        arrays = read_npz(
            path, largest, limits, frozenset() if with_state else frozenset({"state"})
        )
        raw, state = arrays["meta"], arrays["state"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise _bad(path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise _bad(path, "metadata is not JSON bytes")
    try:
        document = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(path, "metadata is not valid JSON") from exc
    meta = _check_meta(document, path)
    if with_state:
        if state.dtype != np.float32 or state.shape != (state_size,):
            raise _bad(
                path,
                f"state is {state.dtype} of shape {state.shape}, expected float32 ({state_size},)",
            )
        if not np.isfinite(state).all():
            raise _bad(path, "state holds NaN or infinite values")
    return meta, state


def write_run_file(directory: Path, info: dict[str, Any]) -> None:
    """Write ``run.json`` (model, dataset, fingerprint, state size, interval)."""
    text = (json.dumps({"format": FORMAT, **info}, indent=2) + "\n").encode()
    write_atomic(directory / RUN_FILE, lambda handle: handle.write(text))


def read_run_file(directory: Path) -> dict[str, Any]:
    """The checked ``run.json`` of a snapshot directory.

    Raises:
        SnapshotError: it is missing or malformed.
    """
    path = directory / RUN_FILE
    try:
        with open_regular(path, MAX_META_BYTES) as handle:
            info = json.loads(handle.read().decode("utf-8"))
    except FileNotFoundError as exc:
        raise SnapshotError(
            f"no snapshots in {directory.parent} ({path} is missing): start the server "
            "with --snapshot-every-updates N"
        ) from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from exc
    wanted = {"model": str, "dataset": str, "fingerprint": str, "state_size": int, "every": int}
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SnapshotError(f"{path} is not a snapshot index of a known format")
    for key, kind in wanted.items():
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            raise SnapshotError(f"{path}: {key} is missing or not a {kind.__name__}")
    if info["state_size"] < 1 or info["every"] < 1:
        raise SnapshotError(f"{path}: state_size and every must be >= 1")
    return info


class SnapshotWriter:
    """Saves every N-th version as the server publishes it, off the event loop.

    Args:
        run_dir: the run directory (snapshots go to ``run_dir/snapshots``).
        every: the interval in updates.
        limit: snapshots kept at most; beyond it the interval doubles (see module doc).
        info: what ``run.json`` records about the run (model, dataset, fingerprint, ...).
        resumed_at: the version a resumed run continues from: snapshots of later versions
            belong to work that is redone, and are deleted.
    """

    def __init__(
        self,
        run_dir: Path,
        every: int,
        *,
        limit: int,
        info: dict[str, Any],
        resumed_at: int | None = None,
    ) -> None:
        self.directory = run_dir / DIRECTORY
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".snap-*.tmp"):
            stale.unlink(missing_ok=True)
        kept = list_snapshots(self.directory)
        if resumed_at is not None:
            for version, path in kept:
                if version > resumed_at:
                    path.unlink()
            kept = [(v, p) for v, p in kept if v <= resumed_at]
        self.every, self.limit, self.info = every, limit, info
        previous = self.directory / RUN_FILE
        if previous.is_file() and kept:  # a resumed run keeps its (possibly doubled) interval
            try:
                self.every = max(every, read_run_file(self.directory)["every"])
            except SnapshotError as exc:
                log.warning("%s; using --snapshot-every-updates %d", exc, every)
        self.versions = [v for v, _ in kept]
        self.written = 0
        self.failed = 0
        self._pending: set[asyncio.Future[None]] = set()
        self._thread = WriteThread("snapshots")
        self._errors = RateLimitedLog(log)
        write_run_file(self.directory, {**info, "every": self.every})

    def due(self, version: int) -> bool:
        """Whether ``version`` is one the interval keeps."""
        return version > 0 and version % self.every == 0 and version not in self.versions

    async def take(self, meta: SnapshotMeta, fetch: Fetch) -> None:
        """Save the published state as ``meta.version`` (call while no update is published).

        The state is held (not copied) until the write thread has saved it.
        """
        version, state, release = await fetch()
        if version != meta.version:
            release()
            log.error(
                "snapshot of version %d skipped: version %d is published", meta.version, version
            )
            return
        future = asyncio.wrap_future(self.submit(meta, state, release))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        if len(self._pending) == MAX_PENDING + 1:  # once per backlog
            log.warning("%d snapshot writes queued (the disk is slower than updates)", MAX_PENDING)

    def submit(
        self, meta: SnapshotMeta, state: np.ndarray, release: Callable[[], None] = lambda: None
    ) -> concurrent.futures.Future[None]:
        """Queue ``state`` to be saved as ``meta.version`` by the write thread (which calls
        ``release`` once it is saved); call from one thread only."""
        self.versions.append(meta.version)
        future = self._thread.submit(lambda: self._save(state, meta, release))
        self._thin()
        return future

    def _save(self, state: np.ndarray, meta: SnapshotMeta, release: Callable[[], None]) -> None:
        try:
            # Room for this snapshot and, after it, for a checkpoint (the state and up to two
            # optimizer slots): snapshots never take the space the final checkpoint needs.
            needed = state.nbytes * (1 + CHECKPOINT_COPIES) + (1 << 20)
            free = shutil.disk_usage(self.directory).free
            if free < needed:
                raise OSError(f"{free >> 20} MiB free, {needed >> 20} MiB kept for a checkpoint")
            write(self.directory, state, meta)
            self.written += 1
        except OSError as exc:
            self.failed += 1
            self._errors.warning(
                "snapshot", "snapshot of version %d not written: %s", meta.version, exc
            )
        finally:
            release()

    def _thin(self) -> None:
        """Past the limit: drop every other snapshot and double the interval.

        Runs on the event loop; deletions queue on the write thread behind the writes.
        """
        kept = [v for v in self.versions if not v % self.every]
        if len(kept) <= self.limit:
            return
        self.every *= 2
        dropped = [v for v in kept if v % self.every]
        self.versions = [v for v in self.versions if v not in dropped]
        info = {**self.info, "every": self.every}
        self._thread.submit(lambda: self._delete(dropped, info))
        log.info("snapshot limit %d reached: now every %d updates", self.limit, self.every)

    def _delete(self, versions: list[int], info: dict[str, Any]) -> None:
        try:
            for version in versions:
                path_for(self.directory, version).unlink(missing_ok=True)
            write_run_file(self.directory, info)
        except OSError as exc:
            log.error("thinning the snapshots failed: %s", exc)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write is done, for at most ``timeout_s`` (None: however
        long); writes still running then are abandoned (and said so)."""
        if not self._pending:
            return
        try:
            await asyncio.wait_for(
                asyncio.gather(*self._pending, return_exceptions=True), timeout_s
            )
        except TimeoutError:
            log.error(
                "abandoned %d snapshot writes still running after %g s (a stuck disk?)",
                len(self._pending),
                timeout_s,
            )

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the write thread after the queued writes, waiting at most ``timeout_s``
        (None: however long they take)."""
        if not self._thread.close(timeout_s):
            log.error("abandoned the snapshot write thread: still writing after %g s", timeout_s)
