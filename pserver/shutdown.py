"""The end of a run: the final checkpoint and evaluation, stopping the workers and writing the
summary, all within ``--shutdown-timeout``; and the watch that ends a run when a shard is lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from common.errors import ShardLost
from common.safefile import run_bounded
from pserver.context import RunContext
from pserver.evaluation import EvalScheduler
from pserver.membership import Roster
from pserver.runstate import RunPhase, RunState
from pserver.snapshots.snapshot_hooks import SnapshotHook
from pserver.store.stores import RemoteStores
from pserver.updates import Updater

log = logging.getLogger(__name__)

SUMMARY_RESERVE_S = 0.5  # of the shutdown budget, kept for writing the summary


class Shutdown:
    """Winds a run down once training ended.

    Args:
        context: the run (``--shutdown-timeout``, which the whole end must fit in, and how long
            the final snapshot writes may take; its record, its phase; the run log the summary
            is written through).
        roster: the workers, whose stops are waited for.
        updater: its lock lets an update being published complete first.
        evaluations: the final evaluation.
        snapshots: the final snapshot.
        final_checkpoint: writes the final checkpoint (None: the run has no run directory).
        stop_waiting: answers every waiting worker with stop.
        summary: the run summary to write.
    """

    def __init__(
        self,
        context: RunContext,
        roster: Roster,
        *,
        updater: Updater,
        evaluations: EvalScheduler,
        snapshots: SnapshotHook,
        final_checkpoint: Callable[[], Awaitable[bool]] | None,
        stop_waiting: Callable[[], None],
        summary: Callable[[], dict[str, Any]],
    ) -> None:
        self.budget_s = context.config.shutdown_timeout_s
        self.write_timeout_s = context.config.write_timeout_s
        self.run, self.log, self.updater, self.roster = context.run, context.log, updater, roster
        self.evaluations, self.snapshots = evaluations, snapshots
        self.checkpoint, self.stop_waiting, self.summary = final_checkpoint, stop_waiting, summary
        self.done = asyncio.Event()  # set once the summary is written

    async def run_to_end(self) -> None:
        """Checkpoint, final evaluation, stop the workers, write the summary: all within the
        budget; whatever fails is reported and the server exits non-zero."""
        run = self.run
        budget = self.budget_s
        deadline = asyncio.get_running_loop().time() + budget
        try:
            await asyncio.wait_for(self._wind_down(deadline), budget)
        except TimeoutError:
            run.error = run.error or (
                f"shutdown did not finish within --shutdown-timeout {budget:g} s"
            )
            log.error("%s", run.error)
        except Exception as exc:
            log.exception("shutdown failed")
            run.error = run.error or f"shutdown failed: {type(exc).__name__}: {exc}"
        finally:
            left = max(deadline - asyncio.get_running_loop().time(), SUMMARY_RESERVE_S)
            summary = self.summary()
            try:
                await run_bounded(lambda: self.log.write_summary(summary), left, "summary.json")
            except OSError as exc:
                run.error = run.error or f"cannot write summary.json: {exc}"
                log.error("%s", run.error)
            if self.log.error and not run.error:
                run.error = self.log.error
            run.phase = RunPhase.DONE
            self.done.set()

    async def _wind_down(self, deadline: float) -> None:
        run = self.run
        async with self.updater.lock:  # an update being published completes first
            await self.snapshots.at_end(self.write_timeout_s)  # --snapshot-every-updates
        if self.updater.version == 0:
            log.info("stopped before the first update: no checkpoint and no final evaluation")
        elif not run.stores_lost:
            if self.checkpoint is not None and not await self.checkpoint():
                run.error = run.error or "the final checkpoint could not be written"
            await self.evaluations.final(self.updater.version)
        self.stop_waiting()
        if not self.roster.members():
            self.roster.emptied.set()
        left = deadline - asyncio.get_running_loop().time() - SUMMARY_RESERVE_S
        try:
            await asyncio.wait_for(self.roster.emptied.wait(), max(left, 0.01))
        except TimeoutError:
            log.info("%d workers did not collect their stop", len(self.roster.members()))


async def watch_shards(
    stores: RemoteStores, every_s: float, run: RunState, lost: Callable[[str], None]
) -> None:
    """Ping the shards while the run lasts; a shard that stops answering ends it.

    Args:
        stores: the shard links.
        every_s: seconds between pings.
        run: the run (the watch ends with training).
        lost: called with what went wrong when a shard is lost.
    """
    await stores.ready.wait()
    while not run.finished:
        await asyncio.sleep(every_s)
        try:
            await stores.ping()
        except ShardLost as exc:
            lost(str(exc))
            return
