"""The push path: a push is checked, its gradient awaited and checked, then decided once by the
mode policy; the decision is carried out here (an update applied and booked, or the push
refused), and the pushes it answers are answered from here."""

from __future__ import annotations

import logging
import math
import time

from common import stagetrace
from common.errors import ErrorCode, ProtocolError, ShardLost
from common.protocol.messages import GradientPushRequest, PushRequest
from pserver.booking import Ledger
from pserver.context import RunBooks, RunContext
from pserver.departures import Departures
from pserver.desk import TaskDesk
from pserver.membership import Task, Waiter, WorkerInfo
from pserver.policies import Update
from pserver.roundtiming import RoundTiming
from pserver.snapshots.snapshot_hooks import SnapshotHook
from pserver.store.stores import ParameterStores
from pserver.transport import Request
from pserver.updates import STRIKES_BEFORE_DROP, GradientGuard

log = logging.getLogger(__name__)

MIN_SPEED, MAX_SPEED = 1e-6, 1e9  # samples/s a worker may report


class Pushes:
    """Takes pushes and applies the updates they make due.

    Args:
        context: the run (mode, stage timeout; nothing is applied once training ended; a
            limit reached ends training, a lost shard fails the run, a checkpoint falls due).
        books: the workers, the policy that decides each accepted push, and the updater that
            applies updates, one at a time under its lock.
        stores: where gradients are staged and updates published.
        guard: refuses absurd gradients and clips (``--max-grad-norm``).
        ledger: books applied updates.
        desk: answers workers with their next task, or stop (and with the errors of pushes
            refused after they waited).
        snapshots: a snapshot of a new version when one is due.
        departures: removes a member whose pushes are refused again and again.
    """

    def __init__(
        self,
        context: RunContext,
        books: RunBooks,
        *,
        stores: ParameterStores,
        guard: GradientGuard,
        ledger: Ledger,
        desk: TaskDesk,
        snapshots: SnapshotHook,
        departures: Departures,
    ) -> None:
        self.config, self.run, self.finish = context.config, context.run, context.finish
        self.fail, self.checkpoint = context.fail, context.checkpoint
        self.roster, self.policy, self.updater = books.roster, books.policy, books.updater
        self.stores, self.guard, self.ledger, self.desk = stores, guard, ledger, desk
        self.snapshots, self.replier, self.drop = snapshots, desk.replier, departures.drop

    async def push(self, request: Request, msg: PushRequest) -> None:
        """The one path of a push: check it, wait for its gradient to be complete in the
        stores, check the gradient, then let the policy decide it and carry that out.

        A shard lost on the way fails the run (nothing more can be applied), and the worker is
        told to stop.

        Raises:
            ProtocolError: the push is refused (the endpoint answers it with the error).
        """
        worker = self.roster.member(msg.worker_id, msg.token, request.user_id)
        waiter = Waiter(request.identity, request.request_id, isinstance(msg, GradientPushRequest))
        try:
            await self._push(worker, waiter, msg)
        except ShardLost as exc:
            self.fail(str(exc), True)
            if worker.active:  # not stopped with the workers that waited: its push waits
                self.roster.wait(worker, waiter)
                self.desk.stop(worker)

    async def _push(self, worker: WorkerInfo, waiter: Waiter, msg: PushRequest) -> None:
        """``push`` for the member ``worker``, whose request ``waiter`` is."""
        roster = self.roster
        if self.run.finished:
            roster.wait(worker, waiter)
            self.desk.stop(worker)
            return
        if msg.task_id == worker.pushing:
            raise ProtocolError(ErrorCode.WRONG_TASK, f"task {msg.task_id} is being pushed already")
        try:
            task = self._pushed_task(worker, msg)
        except ProtocolError as exc:
            if any(t.task_id == msg.task_id for t in worker.tasks):
                # Its chunks may be in: drop them, so that a corrected push can resend them.
                await self.stores.drop([msg.task_id], exc.code, str(exc))
            raise
        roster.begin_push(worker, task)
        try:
            report = await self.stores.staged(
                task.task_id, worker.worker_id, self.config.stage_timeout_s
            )
            if not worker.active or not worker.tasks or worker.tasks[0] is not task:
                raise ProtocolError(
                    ErrorCode.WRONG_TASK, "the task was withdrawn (the worker left)"
                )
            if self.run.finished:  # training ended while the gradient arrived: just stop
                roster.end_push(worker)
                await self.stores.drop([task.task_id], ErrorCode.SHUTTING_DOWN, "training ended")
                roster.wait(worker, waiter)
                self.desk.stop(worker)
                return
            stagetrace.mark("c_staged", task=task.task_id)
            clip = self.guard.check(report, task.task_id, worker.worker_id)
        except ProtocolError as exc:
            roster.end_push(worker)
            if exc.code == ErrorCode.NON_FINITE:
                roster.count(worker, "non_finite")
            elif exc.code == ErrorCode.REFUSED:
                roster.count(worker, "refused")
            await self.stores.drop([task.task_id], exc.code, str(exc))
            if self.guard.struck_out(worker.worker_id):
                reason = f"{STRIKES_BEFORE_DROP} pushes in a row were refused (last: {exc})"
                self.drop(worker, reason)
                raise ProtocolError(exc.code, f"the worker is dropped: {reason}") from None
            raise
        except BaseException:
            roster.end_push(worker)
            raise
        # Accepted: the push counts from here on, even if the worker leaves.
        roster.accepted(
            worker,
            task,
            msg.speed,
            msg.compute_s,
            msg.transfer_s,
            measure_transfer=not self.config.is_sync,  # sync: measured when rounds close
        )
        roster.wait(worker, waiter)
        async with self.updater.lock:
            if self.run.finished:  # the final checkpoint and summary stand: nothing changes
                await self.stores.drop([task.task_id], ErrorCode.SHUTTING_DOWN, "training ended")
                self.ledger.give_back_task(worker, task)
                if worker.active:
                    self.desk.stop(worker)
                return
            stagetrace.mark("c_decide", task=task.task_id)
            decision = self.policy.decide(worker, task, msg, self.updater.version, clip)
            if self.config.is_sync:
                roster.end_push(worker)
            if decision.refusal is not None:
                await self._refuse_push(worker, task, decision.refusal)
            if decision.update is not None:
                await self._apply(decision.update)
            else:  # it may hold another task of this round (taken over from one that left)
                self.desk.dispatch([worker])

    async def _refuse_push(self, worker: WorkerInfo, task: Task, refusal: ProtocolError) -> None:
        """A push the policy refused (too stale): the worker recomputes the same samples on
        fresh parameters; its request is answered with the refusal. A worker that left while
        the push waited recomputes nothing: the samples go back.

        Raises:
            ProtocolError: ``refusal``, always.
        """
        self.roster.count(worker, "rejected")
        self.roster.end_push(worker)
        await self.stores.drop([task.task_id], refusal.code, str(refusal))
        if worker.active:
            self.roster.requeue(worker, task)
        else:
            self.ledger.give_back_task(worker, task)
        self.roster.take_waiter(worker)
        raise refusal

    def _pushed_task(self, worker: WorkerInfo, msg: PushRequest) -> Task:
        """The task a push answers, after checking every field of the push."""
        task = worker.tasks[0] if worker.tasks else None
        if (
            task is None
            or msg.task_id != task.task_id
            or worker.pushing is not None
            or worker.sent_task != task.task_id
        ):
            raise ProtocolError(
                ErrorCode.WRONG_TASK, f"task {msg.task_id} is not the task this worker is running"
            )
        if msg.batch_size != task.size:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"batch_size {msg.batch_size} differs from the task's {task.size}",
            )
        if not 0 <= msg.version <= self.updater.version:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"version {msg.version} was never served")
        check_speed(msg.speed)
        for name in ("compute_s", "transfer_s"):
            if not 0 <= getattr(msg, name) < 1e6:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} {getattr(msg, name)} is absurd")
        return task

    async def _apply(self, update: Update) -> None:
        """Apply ``update``, book it and answer the workers that may run now (call under the
        updater's lock, while training runs)."""
        try:
            refused = await self.updater.apply(update)
        except ShardLost as exc:
            self.fail(str(exc), True)
            return
        stagetrace.mark("c_applied", version=self.updater.version)
        if refused is not None:
            self._refuse_update(update, refused)
            return
        for worker, _, _ in update.entries:  # their pushes are decided: they may get tasks
            self.roster.end_push(worker)
        timing = None if update.clock is None else update.clock.timing(time.monotonic())
        answered = not self.ledger.may_finish()
        if answered:
            # An update that cannot end training: its workers get their next tasks first, and
            # it is booked (metrics, credits, epoch ledgers) while they compute.
            self._answer(update, timing)
        booked = self.ledger.book(update, timing)
        stagetrace.mark("c_booked", version=self.updater.version)
        if booked.checkpoint:
            self.checkpoint()
        if booked.finish is not None:
            self.finish(booked.finish)
        if not answered:  # booked first: its workers may be told to stop
            self._answer(update, timing)
        self.policy.settle(update)
        await self.snapshots.take()
        stagetrace.mark("c_settled", version=self.updater.version)

    def _answer(self, update: Update, timing: RoundTiming | None) -> None:
        """Plan what follows a published update and answer the workers that may run now (or
        tell them to stop, once training ended)."""
        ready = [] if self.run.finished else self.roster.ready()
        assignments = self.policy.after_update(update, timing, ready)
        stagetrace.mark("c_planned", version=self.updater.version)
        self.desk.queue(assignments)
        self.desk.dispatch()

    def _refuse_update(self, update: Update, message: str) -> None:
        """An update the stores refused (it would make the state invalid; they answered its
        chunks): its pushes are answered with the error, its samples go back."""
        self.policy.refused(update)
        self.ledger.give_back(update)
        for worker, _, _ in update.entries:
            self.roster.count(worker, "refused")
            waiter = self.roster.take_waiter(worker)
            if waiter is not None:
                self.replier.reply_error(
                    waiter.identity, waiter.request_id, ErrorCode.REFUSED, message
                )
        self.desk.plan()
        self.desk.dispatch()


def check_speed(speed: float) -> None:
    """Refuse a speed no worker can have.

    Raises:
        ProtocolError: BAD_FIELD.
    """
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"speed must be in [{MIN_SPEED:g}, {MAX_SPEED:g}], got {speed}"
        )
