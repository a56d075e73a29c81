"""Departures: a worker that left or died is removed and its unpushed work planned again."""

from __future__ import annotations

import logging

from common.errors import ErrorCode
from common.training.runlog import RunLog
from pserver.context import RunBooks
from pserver.desk import TaskDesk
from pserver.membership import WorkerInfo
from pserver.store.stores import ParameterStores
from pserver.transport import TaskOwner
from pserver.updates import GradientGuard

log = logging.getLogger(__name__)


class Departures:
    """Removes workers.

    Args:
        books: the roster, the policy (plans a leaver's tasks again) and the sampler (takes
            back their samples).
        log: the run log (``leave`` events).
        guard: forgets a leaver's strikes.
        stores: drop a leaver's staged gradients.
        owner: owns the drops.
        desk: plans and answers the workers that remain.
    """

    def __init__(
        self,
        books: RunBooks,
        log: RunLog,
        *,
        guard: GradientGuard,
        stores: ParameterStores,
        owner: TaskOwner,
        desk: TaskDesk,
    ) -> None:
        self.books, self.log, self.guard = books, log, guard
        self.stores, self.owner, self.desk = stores, owner, desk

    def drop(self, worker: WorkerInfo, reason: str) -> None:
        """Remove a worker that left or died; the policy plans its unpushed tasks again or
        their samples go back.

        Args:
            worker: the member.
            reason: why it is gone (logged).
        """
        if not worker.active:
            return
        roster = self.books.roster
        dropped = roster.take_tasks(worker)
        roster.remove(worker)
        self.guard.forget(worker.worker_id)
        for task in self.books.policy.leave(worker, dropped):
            self.books.sampler.give_back(task.epoch, task.positions)
        self.log.event("leave", worker=worker.name, reason=reason[:200])
        log.info("worker %s is gone: %s", worker.name, reason)
        if dropped:
            ids = [t.task_id for t in dropped]
            self.owner.spawn(self.stores.drop(ids, ErrorCode.UNKNOWN_WORKER, "the worker left"))
        self.desk.plan()
        self.desk.dispatch()
