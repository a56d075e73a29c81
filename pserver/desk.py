"""The task desk: queues the tasks a policy plans and answers workers' waiting requests, with
their next task or with stop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.protocol.messages import ParamsChunk, TaskParamsReply, TaskReply
from common.protocol.tokens import TokenBook
from common.training.runlog import RunLog
from pserver.membership import Roster, Task, WorkerInfo
from pserver.policies import Assignment, ModePolicy
from pserver.runstate import RunState
from pserver.store.pool import Lease
from pserver.store.service import Replier
from pserver.updates import Updater


class TaskDesk:
    """Hands out tasks.

    Args:
        roster: the workers (their queues and waiting requests).
        policy: plans tasks and says which a worker may run.
        replier: sends the replies (the server's endpoint).
        store_tokens: signs each task's push token.
        updater: the published version, which each reply names.
        run: the run (no tasks once training ended; a failure named in stop replies).
        log: the run log (``leave`` events of stopped workers).
        whole_params: the published parameters as one chunk with their lease, or None (for
            replies to pushes that carried their gradient; None when the run cannot fuse).
    """

    def __init__(
        self,
        roster: Roster,
        policy: ModePolicy,
        *,
        replier: Replier,
        store_tokens: TokenBook,
        updater: Updater,
        run: RunState,
        log: RunLog,
        whole_params: Callable[[], tuple[ParamsChunk, Lease | None] | None] | None = None,
    ) -> None:
        self.roster, self.policy, self.replier = roster, policy, replier
        self.store_tokens, self.updater, self.run, self.log = store_tokens, updater, run, log
        self.whole_params = whole_params

    def plan(self) -> None:
        """Queue whatever tasks the policy plans now."""
        if self.run.training:
            self.queue(self.policy.plan(self.roster.ready()))

    def queue(self, assignments: list[Assignment]) -> None:
        """Queue planned tasks."""
        for worker, task in assignments:
            self.roster.queue(worker, task)

    def waiting(self) -> list[WorkerInfo]:
        """Members whose request waits for a task, in join order."""
        return [w for w in self.roster.members() if w.waiter is not None]

    def dispatch(self, workers: list[WorkerInfo] | None = None) -> None:
        """Answer each waiting worker (of ``workers``, default all) with its runnable task, or
        with stop once training ended."""
        if self.run.finished:
            self.stop_waiting()
            return
        for worker in self.waiting() if workers is None else workers:
            task = self.policy.runnable(worker)
            if task is not None:  # the hint: the task it will most likely run next
                self.send(worker, task, worker.tasks[1] if len(worker.tasks) > 1 else None)

    def send(self, worker: WorkerInfo, task: Task, hint: Task | None) -> None:
        """Answer ``worker``'s waiting request with ``task`` to run (and ``hint`` to prefetch);
        a push that carried its gradient gets the published parameters in the same reply."""
        waiter = self.roster.sent(worker, task)
        if waiter is None:
            return
        fields: dict[str, Any] = dict(
            action="train",
            task_id=task.task_id,
            push_token=self.store_tokens.push_token(worker.worker_id, task.task_id),
            version=self.updater.version,
            epoch=task.epoch,
            indices=task.indices,
            prefetch=hint.indices if hint else [],
        )
        whole = self.whole_params() if waiter.with_params and self.whole_params else None
        if whole is None:
            self.replier.reply(waiter.identity, waiter.request_id, TaskReply(**fields))
            return
        params, lease = whole
        reply = TaskParamsReply(
            **fields, params_version=params.version, scale=params.scale, params=params.params
        )
        self.replier.reply(waiter.identity, waiter.request_id, reply, lease=lease)

    def stop_waiting(self) -> None:
        """Tell every waiting worker to stop."""
        for worker in self.waiting():
            self.stop(worker)

    def stop(self, worker: WorkerInfo) -> None:
        """Tell a worker to stop (answering its waiting request); it leaves the run."""
        waiter = self.roster.take_waiter(worker)
        self.roster.remove(worker)
        if waiter is not None:
            self.replier.reply(
                waiter.identity,
                waiter.request_id,
                TaskReply(
                    action="stop",
                    task_id=0,
                    push_token="",
                    version=self.updater.version,
                    epoch=0,
                    indices=[],
                    prefetch=[],
                    failure=self.run.failed,
                    finish_reason=self.run.reason,
                ),
            )
        self.log.event("leave", worker=worker.name, reason="stop")
