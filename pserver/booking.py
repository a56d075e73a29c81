"""What becomes of an update: booked when applied (its ``round``/``push`` event, the workers'
credit, the epoch ledgers, what the new version triggers: evaluation, checkpoint, the end),
or refused or discarded (its samples handed out again exactly once)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from common.errors import ErrorCode, ProtocolError
from pserver.evaluation import VersionInfo
from pserver.membership import WorkerInfo
from pserver.policies import Update
from pserver.policies.sync_rounds import RoundTiming, WorkerTiming

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger(__name__)


def book(ps: ParameterServer, update: Update, tau: int) -> None:
    """Count an applied update (under the updater's lock, right after it was published).

    Args:
        ps: the server.
        update: what was applied.
        tau: its staleness (async; 0 in sync modes).
    """
    version = ps.updater.version
    ps.policy.applied(update, tau)
    now = ps.log.now()
    epoch = update.entries[0][1].epoch if update.entries else 0
    timing = ps.policy.last_timing if ps.config.is_sync else None  # type: ignore[attr-defined]
    workers = []
    for worker, task, _ in update.entries:
        ps.clip.pop(task.task_id, None)
        worker.pushing = None
        ps.roster.credit(worker, task.size)
        entry = {"worker": worker.name, "batch": task.size, "speed": round(worker.speed, 3)}
        if timing is not None:
            part = timing.workers.get(worker.worker_id)
            entry.update(account_round(worker, part, update.round_id))
        workers.append(entry)
    _log_update(ps, update, tau, epoch, workers, timing)
    ps.evaluations.made(
        version, VersionInfo(epoch, ps.updater.samples_applied, now, ps.run.train_time(now))
    )
    every, every_epochs = ps.config.eval_every_updates, ps.config.eval_every
    wanted = every is not None and version % every == 0
    for _, task, _ in update.entries:
        done = _epoch_done(ps, task.epoch, task.positions)
        wanted = wanted or (done is not None and every_epochs > 0 and done % every_epochs == 0)
    if wanted:
        ps.evaluations.request()
    _after_step(ps)


def account_round(worker: WorkerInfo, part: WorkerTiming | None, round_id: int) -> dict[str, Any]:
    """Feed a worker's round timing to its model and idle total; its ``round`` event fields.

    Its time outside compute feeds the model only in a steady round
    (``WorkerInfo.steady_in``).
    """
    if part is None:
        return {}
    worker.idle_s += part.idle_s
    if worker.steady_in(round_id):
        worker.perf.add_transfer(part.transfer_s)
    worker.last_round = round_id
    fields = {
        k: round(getattr(part, k), 6) for k in ("compute_s", "transfer_s", "actual_s", "idle_s")
    }
    if part.predicted_s is not None:
        fields["predicted_s"] = round(part.predicted_s, 6)
    return fields


def _log_update(
    ps: ParameterServer,
    update: Update,
    tau: int,
    epoch: int,
    workers: list[dict[str, Any]],
    timing: RoundTiming | None,
) -> None:
    """A ``round`` event (sync modes, with the round's ``timing``) or a ``push`` event (async)
    in ``metrics.jsonl``."""
    version = ps.updater.version
    if timing is not None:
        ps.log.event(
            "round",
            round=update.round_id,
            epoch=epoch,
            version=version,
            round_s=round(timing.round_s, 6),
            step_s=round(timing.step_s, 6),
            weight=round(sum(update.weights), 6),
            workers=workers,
        )
        return
    pushed = workers[0]
    ps.log.event(
        "push",
        worker=pushed["worker"],
        batch=pushed["batch"],
        speed=pushed["speed"],
        epoch=epoch,
        staleness=tau,
        version=version,
    )


def _epoch_done(ps: ParameterServer, epoch: int, positions: np.ndarray) -> int | None:
    """Record a task's samples as applied; returns the epoch if that completed it."""
    ledger = ps.sampler.record_applied(epoch, positions)
    if not ledger.complete:
        return None
    exactly_once = bool((ledger.uses == 1).all())
    version = ps.updater.version
    ps.log.event(
        "epoch",
        epoch=ledger.epoch,
        samples=ledger.applied,
        exactly_once=exactly_once,
        version=version,
    )
    if exactly_once:
        log.info("epoch %d done at version %d", ledger.epoch, version)
    else:
        log.error("epoch %d did not use every sample exactly once", ledger.epoch)
    ps.sampler.forget(ledger.epoch)
    ps.run.epochs_done = max(ps.run.epochs_done, ledger.epoch)
    return ledger.epoch


def _after_step(ps: ParameterServer) -> None:
    """A periodic checkpoint when one is due; the end of training when a limit is reached."""
    every, steps = ps.config.checkpoint_every, ps.updater.steps
    if every and steps // every > ps.checkpoints_started:
        ps.checkpoints_started = steps // every
        ps.owner.spawn(ps.save_checkpoint())
    if ps.config.max_steps is not None and steps >= ps.config.max_steps:
        ps.finish("max_steps")
    elif ps.sampler.exhausted and not ps.sampler.ledgers:
        ps.finish("epochs")


async def discard(ps: ParameterServer, update: Update) -> None:
    """An update closed after training ended: its samples go back (a resume hands them
    out again) and its workers are told to stop."""
    ps.policy.refused(update)
    await ps.stores.drop(update.task_ids, ErrorCode.SHUTTING_DOWN, "training ended")
    for worker, task, _ in update.entries:
        ps.clip.pop(task.task_id, None)
        worker.pushing = None
        ps.sampler.give_back(task.epoch, task.positions)
        if worker.active:
            ps.stop_worker(worker)


async def refuse(ps: ParameterServer, update: Update, exc: ProtocolError) -> None:
    """An update the stores refused: its pushes are answered with the error; a stale one's
    tasks are recomputed on fresh parameters, any other's samples go back."""
    ps.policy.refused(update)
    if exc.code == ErrorCode.STALE:
        await ps.stores.drop(update.task_ids, exc.code, str(exc))
    for worker, task, _ in update.entries:
        ps.clip.pop(task.task_id, None)
        worker.pushing = None
        if worker.active and exc.code == ErrorCode.STALE:
            worker.tasks.appendleft(task)  # recompute the same samples on fresh parameters
        else:
            ps.sampler.give_back(task.epoch, task.positions)
        if exc.code == ErrorCode.REFUSED:
            worker.refused += 1
        waiter = worker.waiter
        if waiter is not None:
            worker.waiter = None
            ps.endpoint.reply_error(waiter.identity, waiter.request_id, exc.code, str(exc))
    ps.plan()
    ps.release()
