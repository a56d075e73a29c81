"""The server's side of ``--snapshot-every-updates``: its writer, and saving a version right
after it is booked (and the final one at the end), while no other update is published."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.errors import PSError
from pserver.snapshots import SnapshotMeta, SnapshotWriter

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger(__name__)


def writer_for(ps: ParameterServer, resumed: bool) -> SnapshotWriter | None:
    """The run's snapshot writer, or None when snapshots are off.

    Args:
        ps: the server (its state size, dataset and restored version are known).
        resumed: the run continues from a checkpoint (later snapshots are dropped).
    """
    cfg = ps.config
    if cfg.snapshot_every_updates is None or cfg.run_dir is None:
        return None
    info = {
        "mode": cfg.mode,
        "model": cfg.model,
        "dataset": str(cfg.dataset.resolve()),
        "fingerprint": ps.meta.fingerprint,
        "state_size": ps.state_size,
    }
    resumed_at = ps.initial.version if resumed else None
    return SnapshotWriter(
        cfg.run_dir, cfg.snapshot_every_updates, cfg.snapshot_limit, info, resumed_at
    )


async def take(ps: ParameterServer, final: bool = False) -> None:
    """Save the published version if the interval keeps it, or ``final`` and not yet saved
    (call under the updater's lock; a failure is logged and training goes on)."""
    writer = ps.snapshots
    version = ps.updater.version
    if writer is None or ps.stores_lost:
        return
    if not (writer.due(version) or (final and version not in writer.versions)):
        return
    info = ps.evaluations.versions.get(version)
    meta = SnapshotMeta(
        version,
        info.epoch if info else ps.run.epochs_done,
        info.samples if info else ps.updater.samples_applied,
        round(info.train_t if info else ps.run.train_time(ps.log.now()), 6),
        final,
    )
    try:
        await writer.take(meta, ps.newest_state)
    except PSError as exc:
        log.error("snapshot of version %d failed: %s", version, exc)


async def at_end(ps: ParameterServer) -> None:
    """Save the final version and wait for every queued write (under the updater's lock)."""
    if ps.snapshots is not None:
        await take(ps, final=True)
        await ps.snapshots.drain(ps.config.write_timeout_s)
