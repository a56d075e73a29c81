"""The server's side of ``--snapshot-every-updates``: its writer, and saving a version right
after it is booked (and the final one at the end), while no other update is published."""

from __future__ import annotations

import logging
from typing import Any

from common.errors import PSError
from pserver.context import RunContext
from pserver.evaluation import EvalScheduler
from pserver.snapshots.snapshots import Fetch, SnapshotMeta, SnapshotWriter
from pserver.updates import Updater

log = logging.getLogger(__name__)


class SnapshotHook:
    """Takes the run's snapshots (a no-op when snapshots are off).

    Args:
        context: the run (its directory, ``--snapshot-every-updates`` and ``--snapshot-limit``:
            no snapshots without both; its record: stores lost, epochs, training time; the
            run log's clock).
        updater: the published version and its counters.
        info: what identifies the run in its snapshot files (mode, model, dataset, ...).
        resumed_at: the version a resumed run continues from (later snapshots are dropped);
            None for a new run.
        evaluations: what is known of each version (epoch, samples, time).
        newest_state: the published version, its state and the call that lets go of it.
    """

    def __init__(
        self,
        context: RunContext,
        updater: Updater,
        *,
        info: dict[str, Any],
        resumed_at: int | None,
        evaluations: EvalScheduler,
        newest_state: Fetch,
    ) -> None:
        self.config, self.info, self.resumed_at = context.config, info, resumed_at
        self.updater, self.evaluations = updater, evaluations
        self.run, self.log, self.newest_state = context.run, context.log, newest_state
        self.writer: SnapshotWriter | None = None

    def open(self) -> None:
        """Start the writer (when the run directory is written, at the server's start)."""
        cfg = self.config
        if cfg.snapshot_every_updates is not None and cfg.run_dir is not None:
            self.writer = SnapshotWriter(
                cfg.run_dir,
                cfg.snapshot_every_updates,
                limit=cfg.snapshot_limit,
                info=self.info,
                resumed_at=self.resumed_at,
            )

    async def take(self, final: bool = False) -> None:
        """Save the published version if the interval keeps it, or ``final`` and not yet saved
        (call under the updater's lock; a failure is logged and training goes on)."""
        writer = self.writer
        version = self.updater.version
        if writer is None or self.run.stores_lost:
            return
        if not (writer.due(version) or (final and version not in writer.versions)):
            return
        info = self.evaluations.versions.get(version)
        meta = SnapshotMeta(
            version,
            info.epoch if info else self.run.epochs_done,
            info.samples if info else self.updater.samples_applied,
            round(info.train_t if info else self.run.train_time(self.log.now()), 6),
            final,
        )
        try:
            await writer.take(meta, self.newest_state)
        except PSError as exc:
            log.error("snapshot of version %d failed: %s", version, exc)

    async def at_end(self, timeout_s: float) -> None:
        """Save the final version and wait for every queued write (under the updater's lock)."""
        if self.writer is not None:
            await self.take(final=True)
            await self.writer.drain(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Stop the writer; writes still running after ``timeout_s`` are abandoned."""
        if self.writer is not None:
            self.writer.close(timeout_s)

    def summary(self) -> dict[str, Any] | None:
        """The ``snapshots`` entry of the summary's details (None: snapshots are off)."""
        writer = self.writer
        if writer is None:
            return None
        return {"every": writer.every, "written": writer.written, "failed": writer.failed}
