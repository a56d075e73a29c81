"""The parameter server (the coordinator): membership, planning, updates, evaluation, the end.

It owns the roster, the sampler, the mode policy, the parameter stores (its own with
``--shards 1``, else K shard servers) and the run's records. Policies decide; this class acts:
it queues the tasks a policy plans, applies the updates it asks for (one at a time, under the
updater's lock, booking each right after it is published), answers waiting workers and ends
training. Request handling lives in ``pserver.handlers``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import numpy as np
import torch

from common.data.dataset import DatasetReader
from common.errors import ErrorCode, ProtocolError, PSError, ShardLost
from common.protocol.chunks import chunk_elems_for, shard_bounds
from common.protocol.messages import STORE_REQUESTS, WORKER_REQUESTS, TaskReply
from common.protocol.shard_messages import ShardHello
from common.protocol.tokens import TokenBook, new_key
from common.training.evaluator import Evaluator
from common.training.flat import FlatLayout, nonnegative_bounds
from common.training.models import build_model
from common.training.runlog import RunLog
from pserver import checkpoint, rundir
from pserver.config import ServerConfig
from pserver.evaluation import EvalScheduler, VersionInfo
from pserver.handlers import Handlers
from pserver.membership import Roster, TaskFactory, WorkerInfo
from pserver.optimizer import FlatOptimizer
from pserver.policies import POLICIES, Update
from pserver.runstate import RunState
from pserver.sampler import EpochSampler
from pserver.store.service import StoreService
from pserver.store.slices import SliceStore
from pserver.store.stores import CapturedState, LocalStores, RemoteStores
from pserver.summary import build_summary
from pserver.transport import Endpoint, TaskOwner
from pserver.updates import GradientGuard, Updater

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.5
SUMMARY_RESERVE_S = 0.5  # of the shutdown budget, kept for writing the summary


def make_optimizer(config: ServerConfig) -> FlatOptimizer:
    """The run's optimizer (for one slice of the parameters)."""
    return FlatOptimizer(
        config.optimizer, config.lr, config.momentum, config.nesterov, config.weight_decay
    )


class ParameterServer:
    """Holds the run and serves workers until training ends.

    Use as ``async with ParameterServer(cfg) as ps: summary = await ps.serve()``.

    Args:
        config: the server configuration.

    Raises:
        ConfigError: the run directory or checkpoint does not fit the arguments.
        DatasetError, ModelError: the dataset or model cannot be loaded.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        resumed = rundir.prepare(config)
        self.log = RunLog(config.run_dir, resume_at=resumed.meta["t"] if resumed else None)
        self.reader = DatasetReader(config.dataset, cache_bytes=config.cache_mb << 20)
        self.meta = meta = self.reader.meta
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        channels, height, _ = meta.shape
        model = build_model(config.model, channels, meta.num_classes, height)
        layout = FlatLayout(model)
        self.num_params, self.state_size = layout.num_params, layout.size
        self.nonneg = nonnegative_bounds(model, layout)
        self.initial = CapturedState(0, 0, [], layout.read_state().numpy(), np.zeros((0, 0)))
        train_count = len(self.reader.train_indices)
        self.run = RunState()
        self.sampler = EpochSampler(train_count, config.seed, config.epochs)
        self.tasks = TaskFactory(self.reader.train_indices)
        self.policy = POLICIES[config.mode](config, self.sampler, self.tasks)
        self.tokens = TokenBook(new_key())
        self.shard_key = new_key()
        self.server_id = secrets.token_hex(8)
        self.roster = Roster(config.dead_after_s, self._on_dead, self.tokens, config.max_workers)
        self.owner = TaskOwner()
        self.chunk_elems = chunk_elems_for(config.chunk_bytes, config.wire_dtype)
        self.http: Any = None  # the status page (pserver.statuspage), with --http
        self.endpoint = Endpoint(
            config.bind,
            {**WORKER_REQUESTS, **STORE_REQUESTS, ShardHello.TYPE: ShardHello},
            self.chunk_elems * 4 + (4 << 20),
            self.owner,
            config.curve_secret,
            config.authorized_keys,
        )
        self.guard = GradientGuard(config.max_grad_norm, config.outlier_factor)
        self.clip: dict[int, float] = {}
        self.address = ""
        self.started = False
        self._done = asyncio.Event()
        self._workers_gone = asyncio.Event()
        self._checkpoint_lock = asyncio.Lock()
        self._checkpoints = 0
        self._flusher: asyncio.TimerHandle | None = None
        self._stores_lost = False
        if resumed is not None:
            self.initial = checkpoint.restore_into(self, resumed)
        self.stores: LocalStores | RemoteStores = self._make_stores()
        self.updater = Updater(config, self.stores, train_count)
        self.updater.restore(
            self.initial.version,
            int(resumed.meta["steps"]) if resumed else 0,
            int(resumed.meta["samples_applied"]) if resumed else 0,
        )
        self.evaluations = EvalScheduler(
            Evaluator(model, self.reader, meta.num_classes, config.eval_batch),
            self.log,
            self._newest_state,
            config.eval_samples,
            config.seed,
            self._on_eval,
        )
        self.handlers = Handlers(self)

    def _make_stores(self) -> LocalStores | RemoteStores:
        cfg = self.config
        if cfg.shards > 1:
            return RemoteStores(
                shard_bounds(self.state_size, cfg.shards), self.shard_key, cfg.shard_timeout_s
            )
        store = SliceStore(
            0,
            self.state_size,
            self.num_params,
            torch.from_numpy(self.initial.state.astype(np.float32)),
            make_optimizer(cfg),
            self.nonneg,
            self.chunk_elems,
            self.initial.version,
        )
        if self.initial.slots:
            store.load_slots(
                self.initial.slots,
                torch.from_numpy(self.initial.slot_state),
                self.initial.optimizer_steps,
            )
        service = StoreService(
            store, cfg.wire_dtype, self.tokens, self.endpoint, cfg.stage_timeout_s
        )
        return LocalStores(service)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket; ``self.address`` is then the endpoint workers connect to.

        Raises:
            ConfigError: the address (or the status page's port) cannot be bound.
        """
        if self.config.http_port is not None:
            from pserver.statuspage import start_for_server

            self.http = await start_for_server(self)
        self.address = self.endpoint.bind()
        warm = self.reader.train_indices[:1]
        self.owner.spawn(asyncio.get_running_loop().run_in_executor(None, self.reader.read, warm))
        self.log.event(
            "start",
            address=self.address,
            mode=self.config.mode,
            model=self.config.model,
            dataset=str(self.config.dataset),
            state_size=self.state_size,
            shards=self.config.shards,
            wire_dtype=self.config.wire_dtype,
            train=len(self.reader.train_indices),
            test=len(self.reader.test_indices),
        )
        self._schedule_flush()
        log.info(
            "serving %s on %s (%d parameters and buffers, %d training samples, %d shard%s)",
            self.config.mode,
            self.address,
            self.state_size,
            len(self.reader.train_indices),
            self.config.shards,
            "" if self.config.shards == 1 else "s",
        )
        if self.run.finished:  # resumed a run that had already ended
            log.info("the run had already ended (%s); writing its summary", self.run.finish_reason)
            self.owner.spawn(self._shutdown())
        elif isinstance(self.stores, RemoteStores):
            self.owner.spawn(self._watch_shards())

    def _schedule_flush(self) -> None:
        self.log.flush()
        self._flusher = asyncio.get_running_loop().call_later(FLUSH_EVERY_S, self._schedule_flush)

    async def serve(self) -> dict[str, Any]:
        """Serve until training has ended and the summary is written.

        Returns:
            The run summary (also written to ``summary.json``).
        """
        receiver = asyncio.create_task(self.endpoint.receive_loop(self.handlers.dispatch))
        try:
            await self._done.wait()
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return build_summary(self)

    def request_stop(self) -> None:
        """End training now (signals call this); shutdown then proceeds within its timeout."""
        self.finish("stopped")

    async def close(self) -> None:
        """Cancel outstanding tasks, close the sockets and release the dataset."""
        if self.http is not None:
            await self.http.close()
        if self._flusher is not None:
            self._flusher.cancel()
        await self.evaluations.close()
        await self.owner.cancel_all()
        await self.stores.close("the server closed")
        self.roster.close()
        self.endpoint.close()
        self.reader.close()
        self.log.close()

    async def __aenter__(self) -> ParameterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- what the server does ---------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Training has ended."""
        return self.run.finished

    def plan(self) -> None:
        """Queue whatever tasks the policy plans now."""
        if self.finished or not self.started:
            return
        for worker, task in self.policy.plan(self.roster.ready()):
            worker.tasks.append(task)

    def release(self) -> None:
        """Answer each waiting worker with its runnable task, or with stop once training ended."""
        for worker in self.roster.members():
            waiter = worker.waiter
            if waiter is None:
                continue
            if self.finished:
                self.stop_worker(worker)
                continue
            task = self.policy.runnable(worker)
            if task is None:
                continue
            hint = self.policy.prefetch_hint(worker)
            worker.waiter = None
            self.endpoint.reply(
                waiter.identity,
                waiter.request_id,
                TaskReply(
                    action="train",
                    task_id=task.task_id,
                    push_token=self.tokens.push_token(worker.worker_id, task.task_id),
                    version=self.updater.version,
                    epoch=task.epoch,
                    indices=task.indices,
                    prefetch=hint.indices if hint else [],
                ),
            )

    def stop_worker(self, worker: WorkerInfo) -> None:
        """Tell a waiting worker to stop; it leaves the run."""
        waiter = worker.waiter
        self.roster.remove(worker)
        if waiter is not None:
            self.endpoint.reply(
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
                ),
            )
        self.log.event("leave", worker=worker.name, reason="stop")
        if not self.roster.members():
            self._workers_gone.set()

    def start_training(self) -> None:
        """Enough workers are ready: plan the first tasks."""
        self.started = True
        if self.run.train_start is None:  # not when resuming
            self.run.train_start = self.log.now()
        self.log.event(
            "train_start", workers=len(self.roster.ready()), version=self.updater.version
        )

    def drop_worker(self, worker: WorkerInfo, reason: str) -> None:
        """Remove a worker that left or died; samples of tasks it never pushed go back."""
        if not worker.active:
            return
        dropped = list(worker.tasks)
        worker.tasks.clear()
        self.roster.remove(worker)
        for task in dropped:
            self.sampler.give_back(task.epoch, task.positions)
        self.log.event("leave", worker=worker.name, reason=reason[:200])
        log.info("worker %s is gone: %s", worker.name, reason)
        update = self.policy.leave(worker, dropped)
        if dropped:
            ids = [t.task_id for t in dropped]
            self.owner.spawn(self.stores.drop(ids, ErrorCode.UNKNOWN_WORKER, "the worker left"))
        if update is not None:
            self.owner.spawn(self.run_update(update))
        if not self.roster.members():
            self._workers_gone.set()
        self.plan()
        self.release()

    def _on_dead(self, worker: WorkerInfo) -> None:
        self.drop_worker(worker, f"dead: silent for {self.config.dead_after_s:g} s")

    async def run_update(self, update: Update) -> bool:
        """Apply an update the policy asked for and book it; or, if it is refused, answer its
        pushes with the error and hand its samples out again.

        Returns:
            Whether it was applied.
        """
        async with self.updater.lock:
            if self.finished:  # the final checkpoint and summary stand: nothing changes now
                await self._discarded(update)
                return False
            try:
                tau = await self.updater.apply(update, self.clip)
            except ProtocolError as exc:
                await self._refused(update, exc)
                return False
            except ShardLost as exc:
                self.fail(str(exc), stores_lost=True)
                return False
            self._book(update, tau)
        self.plan()
        self.release()
        return True

    async def _discarded(self, update: Update) -> None:
        """An update closed after training ended: its samples go back (a resume hands them
        out again) and its workers are told to stop."""
        self.policy.refused(update)
        await self.stores.drop(update.task_ids, ErrorCode.SHUTTING_DOWN, "training ended")
        for worker, task, _ in update.entries:
            self.clip.pop(task.task_id, None)
            worker.pushing = None
            self.sampler.give_back(task.epoch, task.positions)
            if worker.active:
                self.stop_worker(worker)

    async def _refused(self, update: Update, exc: ProtocolError) -> None:
        self.policy.refused(update)
        if exc.code == ErrorCode.STALE:
            await self.stores.drop(update.task_ids, exc.code, str(exc))
        for worker, task, _ in update.entries:
            self.clip.pop(task.task_id, None)
            worker.pushing = None
            if worker.active and exc.code == ErrorCode.STALE:
                worker.tasks.appendleft(task)  # recompute the same samples on fresh parameters
            else:
                self.sampler.give_back(task.epoch, task.positions)
            if exc.code == ErrorCode.REFUSED:
                worker.refused += 1
            waiter = worker.waiter
            if waiter is not None:
                worker.waiter = None
                self.endpoint.reply_error(waiter.identity, waiter.request_id, exc.code, str(exc))
        self.plan()
        self.release()

    def _book(self, update: Update, tau: int) -> None:
        """Count an applied update (under the updater's lock, right after it was published)."""
        cfg, sampler, version = self.config, self.sampler, self.updater.version
        self.policy.applied(update, tau)
        now = self.log.now()
        workers = []
        epoch = update.entries[0][1].epoch if update.entries else 0
        for worker, task, _ in update.entries:
            self.clip.pop(task.task_id, None)
            worker.pushing = None
            self.roster.credit(worker, task.size)
            workers.append(
                {"worker": worker.name, "batch": task.size, "speed": round(worker.speed, 3)}
            )
        if cfg.is_sync:
            self.log.event(
                "round",
                round=update.round_id,
                epoch=epoch,
                version=version,
                round_s=round(self.policy.round_times[-1], 6),  # type: ignore[attr-defined]
                workers=workers,
            )
        else:
            pushed = workers[0]
            self.log.event(
                "push",
                worker=pushed["worker"],
                batch=pushed["batch"],
                speed=pushed["speed"],
                epoch=epoch,
                staleness=tau,
                version=version,
            )
        self.evaluations.made(
            version,
            VersionInfo(epoch, self.updater.samples_applied, now, self.run.train_time(now)),
        )
        wanted = cfg.eval_every_updates is not None and version % cfg.eval_every_updates == 0
        for _, task, _ in update.entries:
            ledger = sampler.record_applied(task.epoch, task.positions)
            if not ledger.complete:
                continue
            exactly_once = bool((ledger.uses == 1).all())
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
            sampler.forget(ledger.epoch)
            self.run.epochs_done = max(self.run.epochs_done, ledger.epoch)
            wanted = wanted or ledger.epoch % cfg.eval_every == 0
        if wanted:
            self.evaluations.request()
        every = cfg.checkpoint_every
        if every and self.updater.steps // every > self._checkpoints:
            self._checkpoints = self.updater.steps // every
            self.owner.spawn(self.save_checkpoint())
        if cfg.max_steps is not None and self.updater.steps >= cfg.max_steps:
            self.finish("max_steps")
        elif sampler.exhausted and not sampler.ledgers:
            self.finish("epochs")

    # --- evaluation, checkpoints and the end of training ------------------------------------

    async def _newest_state(self) -> tuple[int, np.ndarray, Any]:
        if isinstance(self.stores, LocalStores):
            version, state, lease = self.stores.published()
            return version, state, lease.release
        captured = await self.stores.capture(with_slots=False)
        return captured.version, captured.state, lambda: None

    def _on_eval(self, record: dict[str, Any]) -> None:
        self.run.evals.append(record)
        target = self.config.target_oa
        if target is not None and record["oa"] >= target and self.run.time_to_target is None:
            self.run.time_to_target = record["train_t"]
            self.finish("target_oa")

    def finish(self, reason: str) -> None:
        """End training: no more tasks; waiting workers are told to stop."""
        if self.run.finished:
            return
        self.run.finish_reason = reason
        self.run.train_end = self.log.now()
        log.info("training finished (%s) at version %d", reason, self.updater.version)
        self.log.event("finish", reason=reason, version=self.updater.version)
        self.release()
        self.owner.spawn(self._shutdown())

    def fail(self, reason: str, stores_lost: bool = False) -> None:
        """End the run because of an error; the server will exit non-zero.

        Args:
            reason: what went wrong (logged and kept in the summary).
            stores_lost: a shard is gone, so no final checkpoint or evaluation is possible
                (the last periodic checkpoint is the one to resume from).
        """
        log.error("%s", reason)
        self._stores_lost = self._stores_lost or stores_lost
        if not self.run.error:
            self.run.error = reason
        self.finish(f"failed: {reason}")

    async def save_checkpoint(self) -> bool:
        """Write a checkpoint now (one at a time); a failure is logged and training goes on.

        Returns:
            Whether it was written.
        """
        async with self._checkpoint_lock:
            try:
                await checkpoint.save(self)
                return True
            except (OSError, PSError) as exc:
                log.error("checkpoint failed: %s", exc)
                self.log.event("checkpoint_failed", error=str(exc)[:300])
                return False

    async def _watch_shards(self) -> None:
        """Ping the shards while the run lasts; a shard that stops answering ends it."""
        assert isinstance(self.stores, RemoteStores)
        await self.stores.ready.wait()
        while not self.finished:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                await self.stores.ping()
            except ShardLost as exc:
                self.fail(str(exc), stores_lost=True)
                return

    async def _shutdown(self) -> None:
        """Checkpoint, final evaluation, stop the workers, write the summary: all within
        ``--shutdown-timeout``; whatever fails is reported and the server exits non-zero."""
        deadline = asyncio.get_running_loop().time() + self.config.shutdown_timeout_s
        try:
            await asyncio.wait_for(self._wind_down(deadline), self.config.shutdown_timeout_s)
        except TimeoutError:
            self.run.error = self.run.error or (
                f"shutdown did not finish within --shutdown-timeout "
                f"{self.config.shutdown_timeout_s:g} s"
            )
            log.error("%s", self.run.error)
        except Exception as exc:
            log.exception("shutdown failed")
            self.run.error = self.run.error or f"shutdown failed: {type(exc).__name__}: {exc}"
        finally:
            try:
                self.log.write_summary(build_summary(self))
            except OSError as exc:
                self.run.error = self.run.error or f"cannot write summary.json: {exc}"
                log.error("%s", self.run.error)
            if self.log.error and not self.run.error:
                self.run.error = self.log.error
            self._done.set()

    async def _wind_down(self, deadline: float) -> None:
        async with self.updater.lock:
            pass  # an update being published completes first
        if not self._stores_lost:
            if self.config.run_dir is not None and not await self.save_checkpoint():
                self.run.error = self.run.error or "the final checkpoint could not be written"
            await self.evaluations.final(self.updater.version)
        self.release()
        if not self.roster.members():
            self._workers_gone.set()
        left = deadline - asyncio.get_running_loop().time() - SUMMARY_RESERVE_S
        try:
            await asyncio.wait_for(self._workers_gone.wait(), max(left, 0.01))
        except TimeoutError:
            log.info("%d workers did not collect their stop", len(self.roster.members()))
