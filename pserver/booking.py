"""The ledger of applied updates: each update's ``round``/``push`` event, the workers' credit,
the epoch ledgers, and what a new version makes due (an evaluation, a checkpoint, the end)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from common.protocol.ending import FinishReason
from common.training.runlog import RunLog
from pserver.config import ServerConfig
from pserver.evaluation import EvalScheduler, VersionInfo
from pserver.membership import Roster, Task, WorkerInfo
from pserver.policies import Update
from pserver.roundtiming import RoundTiming
from pserver.runstate import RunState
from pserver.sampler import EpochSampler
from pserver.updates import Updater

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Booked:
    """What booking an update found due.

    Attributes:
        checkpoint: a periodic checkpoint (``--checkpoint-every``).
        finish: training is over, and why.
    """

    checkpoint: bool
    finish: FinishReason | None


class Ledger:
    """Books every published update.

    Args:
        config: the server configuration (evaluation and checkpoint intervals, limits).
        log: the run log (``round``, ``push`` and ``epoch`` events).
        run: the run's record (epochs done, training time).
        sampler: the epoch sampler (its ledgers count applied samples).
        roster: credits workers and feeds their round timing.
        updater: the counters of published versions.
        evaluations: asked for an evaluation when one is due.
    """

    def __init__(
        self,
        config: ServerConfig,
        log: RunLog,
        *,
        run: RunState,
        sampler: EpochSampler,
        roster: Roster,
        updater: Updater,
        evaluations: EvalScheduler,
    ) -> None:
        self.config, self.log, self.run = config, log, run
        self.sampler, self.roster, self.updater = sampler, roster, updater
        self.evaluations = evaluations
        self.checkpoints_started = 0

    def may_finish(self) -> bool:
        """Whether booking the update just published could end training (its step reached
        ``--max-steps``, or the last epoch's samples are all handed out)."""
        steps = self.config.max_steps
        return (steps is not None and self.updater.steps >= steps) or self.sampler.exhausted

    def book(self, update: Update, timing: RoundTiming | None) -> Booked:
        """Count an update after it was published (under the updater's lock).

        Args:
            update: the update.
            timing: its round's timing (sync modes; None in async).

        Returns:
            What it made due.
        """
        version = self.updater.version
        now = self.log.now()
        epoch = update.entries[0][1].epoch if update.entries else 0
        workers: dict[int, dict[str, Any]] = {}  # one entry per worker, its tasks summed
        for worker, task, _ in update.entries:
            self.roster.credit(worker, task.size)
            accepted_t = round(task.accepted_at - self.log.started, 6)
            entry = workers.get(worker.worker_id)
            if entry is not None:
                entry["batch"] += task.size
                entry["accepted_t"] = max(entry["accepted_t"], accepted_t)
                continue
            entry = {"worker": worker.name, "batch": task.size, "speed": round(worker.speed, 3)}
            entry["accepted_t"] = accepted_t
            if timing is None:  # async: one push, its compute time just reported
                entry["compute_s"] = round(worker.compute_s, 6)
            else:
                part = timing.workers.get(worker.worker_id)
                entry.update(self.roster.account_round(worker, part, update.round_id))
            workers[worker.worker_id] = entry
        self._log_update(update, epoch, list(workers.values()), timing)
        self.evaluations.made(
            version,
            VersionInfo(epoch, self.updater.samples_applied, now, self.run.train_time(now)),
        )
        every, every_epochs = self.config.eval_every_updates, self.config.eval_every
        wanted = every is not None and version % every == 0
        for _, task, _ in update.entries:
            done = self._epoch_done(task.epoch, task.positions)
            wanted = wanted or (done is not None and every_epochs > 0 and done % every_epochs == 0)
        if wanted:
            self.evaluations.request()
        return Booked(self._checkpoint_due(), self._finish_due())

    def give_back(self, update: Update) -> None:
        """An update that will never be applied: its samples go back to the sampler."""
        for worker, task, _ in update.entries:
            self.give_back_task(worker, task)

    def give_back_task(self, worker: WorkerInfo, task: Task) -> None:
        """A pushed task that will never be applied: its samples go back to the sampler."""
        self.roster.end_push(worker)
        self.sampler.give_back(task.epoch, task.positions)

    def _log_update(
        self,
        update: Update,
        epoch: int,
        workers: list[dict[str, Any]],
        timing: RoundTiming | None,
    ) -> None:
        """A ``round`` event (sync modes, with the round's ``timing``) or a ``push`` event
        (async) in ``metrics.jsonl``."""
        version = self.updater.version
        if timing is not None:
            self.log.event(
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
        self.log.event(
            "push",
            **workers[0],
            epoch=epoch,
            staleness=update.staleness,
            lr_scale=update.lr_scale,
            version=version,
        )

    def _epoch_done(self, epoch: int, positions: np.ndarray) -> int | None:
        """Record a task's samples as applied; returns the epoch if that completed it."""
        ledger = self.sampler.record_applied(epoch, positions)
        if not ledger.complete:
            return None
        exactly_once = bool((ledger.uses == 1).all())
        version = self.updater.version
        self.log.event(
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
        self.sampler.forget(ledger.epoch)
        self.run.epochs_done = max(self.run.epochs_done, ledger.epoch)
        return ledger.epoch

    def _checkpoint_due(self) -> bool:
        every, steps = self.config.checkpoint_every, self.updater.steps
        if every and steps // every > self.checkpoints_started:
            self.checkpoints_started = steps // every
            return True
        return False

    def _finish_due(self) -> FinishReason | None:
        if self.config.max_steps is not None and self.updater.steps >= self.config.max_steps:
            return FinishReason.MAX_STEPS
        if self.sampler.exhausted and not self.sampler.ledgers:
            return FinishReason.EPOCHS
        return None
