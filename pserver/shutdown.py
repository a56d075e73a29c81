"""The end of a run: the final checkpoint and evaluation, stopping the workers and writing the
summary, all within ``--shutdown-timeout``; and the watch that ends a run when a shard is lost."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from common.errors import ShardLost
from common.safefile import run_bounded
from pserver.snapshot_hooks import at_end
from pserver.store.stores import RemoteStores
from pserver.summary import build_summary

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger(__name__)

SUMMARY_RESERVE_S = 0.5  # of the shutdown budget, kept for writing the summary


async def shutdown(ps: ParameterServer) -> None:
    """Checkpoint, final evaluation, stop the workers, write the summary: all within
    ``--shutdown-timeout``; whatever fails is reported and the server exits non-zero."""
    budget = ps.config.shutdown_timeout_s
    deadline = asyncio.get_running_loop().time() + budget
    try:
        await asyncio.wait_for(_wind_down(ps, deadline), budget)
    except TimeoutError:
        ps.run.error = ps.run.error or (
            f"shutdown did not finish within --shutdown-timeout {budget:g} s"
        )
        log.error("%s", ps.run.error)
    except Exception as exc:
        log.exception("shutdown failed")
        ps.run.error = ps.run.error or f"shutdown failed: {type(exc).__name__}: {exc}"
    finally:
        left = max(deadline - asyncio.get_running_loop().time(), SUMMARY_RESERVE_S)
        summary = build_summary(ps)
        try:
            await run_bounded(lambda: ps.log.write_summary(summary), left, "summary.json")
        except OSError as exc:
            ps.run.error = ps.run.error or f"cannot write summary.json: {exc}"
            log.error("%s", ps.run.error)
        if ps.log.error and not ps.run.error:
            ps.run.error = ps.log.error
        ps.done.set()


async def _wind_down(ps: ParameterServer, deadline: float) -> None:
    async with ps.updater.lock:  # an update being published completes first
        await at_end(ps)  # the final snapshot (--snapshot-every-updates)
    if ps.updater.version == 0:
        log.info("stopped before the first update: no checkpoint and no final evaluation")
    elif not ps.stores_lost:
        if ps.config.run_dir is not None and not await ps.save_checkpoint():
            ps.run.error = ps.run.error or "the final checkpoint could not be written"
        await ps.evaluations.final(ps.updater.version)
    ps.release()
    if not ps.roster.members():
        ps.workers_gone.set()
    left = deadline - asyncio.get_running_loop().time() - SUMMARY_RESERVE_S
    try:
        await asyncio.wait_for(ps.workers_gone.wait(), max(left, 0.01))
    except TimeoutError:
        log.info("%d workers did not collect their stop", len(ps.roster.members()))


async def watch_shards(ps: ParameterServer) -> None:
    """Ping the shards while the run lasts; a shard that stops answering ends it."""
    assert isinstance(ps.stores, RemoteStores)
    await ps.stores.ready.wait()
    while not ps.finished:
        await asyncio.sleep(ps.config.heartbeat_s)
        try:
            await ps.stores.ping()
        except ShardLost as exc:
            ps.fail(str(exc), stores_lost=True)
            return
