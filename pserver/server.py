"""The parameter server (the coordinator): membership, planning, updates, evaluation, the end.

It owns the roster, the sampler, the mode policy, the parameter stores (its own with
``--shards 1``, else K shard servers; ``pserver.store.build``) and the run's records. Policies
decide; this class acts: it queues the tasks a policy plans, applies the updates it asks for
(one at a time, under the updater's lock; ``pserver.booking`` books each right after it is
published, or hands a refused one's samples back), answers waiting workers and ends training
(``pserver.shutdown``). Request handling lives in ``pserver.handlers``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import numpy as np
import torch

from common.data.dataset import DatasetReader
from common.errors import ErrorCode, ProtocolError, PSError, ShardLost
from common.protocol.chunks import chunk_elems_for
from common.protocol.messages import STORE_REQUESTS, WORKER_REQUESTS, TaskReply
from common.protocol.security import shard_secret
from common.protocol.shard_messages import ShardHello
from common.protocol.tokens import TokenBook, new_key
from common.training.evaluator import Evaluator
from common.training.flat import FlatLayout, nonnegative_bounds
from common.training.models import build_model, has_batchnorm
from common.training.runlog import RunLog
from pserver import checkpoint, rundir
from pserver.booking import book, discard, refuse
from pserver.config import ServerConfig
from pserver.evaluation import EvalScheduler
from pserver.handlers import Handlers
from pserver.membership import Roster, TaskFactory, WorkerInfo
from pserver.policies import POLICIES, Update
from pserver.policies.weighted_sync import resolve_min_local_batch
from pserver.runstate import RunState
from pserver.sampler import EpochSampler
from pserver.shutdown import shutdown, watch_shards
from pserver.snapshot_hooks import take as take_snapshot
from pserver.snapshot_hooks import writer_for
from pserver.snapshots import SnapshotWriter
from pserver.store.build import build_stores
from pserver.store.stores import CapturedState, LocalStores, RemoteStores
from pserver.summary import build_summary
from pserver.transport import Endpoint, TaskOwner
from pserver.updates import GradientGuard, Updater

log = logging.getLogger(__name__)

FAILED = "failed: "  # the finish reason of a run ended by ``fail``

FLUSH_EVERY_S = 0.5


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
        resume_at = resumed.meta["t"] if resumed else None
        self.log = RunLog(config.run_dir, resume_at=resume_at, open_now=False)  # see start()
        self.reader = DatasetReader(config.dataset, cache_bytes=config.cache_mb << 20)
        self.meta = meta = self.reader.meta
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        channels, height, _ = meta.shape
        model = build_model(config.model, channels, meta.num_classes, height)
        self.config = config = resolve_min_local_batch(config, has_batchnorm(model))
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
        self.store_tokens = self.tokens.derive("store")  # what the stores (and shards) check
        self.shard_key = new_key()
        self.shard_secret = (
            shard_secret(config.shard_secret_file, config.curve_secret)
            if config.shards > 1
            else None
        )
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
            allow_own_key=config.shards > 1,  # shards hold the server's key pair
        )
        self.guard = GradientGuard(config.max_grad_norm, config.outlier_factor)
        self.clip: dict[int, float] = {}
        self.address = ""
        self.started = False
        self.done = asyncio.Event()
        self.workers_gone = asyncio.Event()
        self._checkpoint_lock = asyncio.Lock()
        self.checkpoints_started = 0
        self._flusher: asyncio.TimerHandle | None = None
        self.stores_lost = False
        if resumed is not None:
            self.initial = checkpoint.restore_into(self, resumed)
        self.stores: LocalStores | RemoteStores = build_stores(self)
        self.updater = Updater(config, self.stores, train_count)
        self.updater.restore(
            self.initial.version,
            int(resumed.meta["steps"]) if resumed else 0,
            int(resumed.meta["samples_applied"]) if resumed else 0,
        )
        self.evaluations = EvalScheduler(
            Evaluator(model, self.reader, meta.num_classes, config.eval_batch),
            self.log,
            self.newest_state,
            config.eval_samples,
            config.seed,
            self._on_eval,
        )
        self.handlers = Handlers(self)
        self.resumed = resumed is not None
        self.snapshots: SnapshotWriter | None = None  # --snapshot-every-updates, see start()

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket, then write the run directory; ``self.address`` is then the endpoint
        workers connect to. Nothing is written into the run directory before this point, so a
        start that fails (a bad input, a port in use) leaves it as it was.

        Raises:
            ConfigError: the address (or the status page's port) cannot be bound.
        """
        if self.config.http_port is not None:
            from pserver.statuspage import start_for_server

            self.http = await start_for_server(self)
        self.address = self.endpoint.bind()
        rundir.clear(self.config)  # --overwrite
        self.log.open()
        self.snapshots = writer_for(self, self.resumed)
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
            self.owner.spawn(shutdown(self))
        elif isinstance(self.stores, RemoteStores):
            self.owner.spawn(watch_shards(self))

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
            await self.done.wait()
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
        if self.snapshots is not None:
            self.snapshots.close(1.0)  # drained (or abandoned) within the shutdown budget
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

    @property
    def failure(self) -> str | None:
        """The failure that ended training (``fail``), or None."""
        reason = self.run.finish_reason or ""
        return reason.removeprefix(FAILED) if reason.startswith(FAILED) else None

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
            worker.released_at = time.monotonic()
            self.endpoint.reply(
                waiter.identity,
                waiter.request_id,
                TaskReply(
                    action="train",
                    task_id=task.task_id,
                    push_token=self.store_tokens.push_token(worker.worker_id, task.task_id),
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
                    failure=self.failure,
                    finish_reason=worker.finish_reason(self.run.reply_reason),
                ),
            )
        self.log.event("leave", worker=worker.name, reason="stop")
        if not self.roster.members():
            self.workers_gone.set()

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
            self.workers_gone.set()
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
                await discard(self, update)
                return False
            try:
                tau = await self.updater.apply(update, self.clip)
            except ProtocolError as exc:
                await refuse(self, update, exc)
                return False
            except ShardLost as exc:
                self.fail(str(exc), stores_lost=True)
                return False
            book(self, update, tau)
            await take_snapshot(self)
        self.plan()
        self.release()
        return True

    # --- evaluation, checkpoints and the end of training ------------------------------------

    async def newest_state(self) -> tuple[int, np.ndarray, Any]:
        """The published version, its state and the call that releases it."""
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
        self.owner.spawn(shutdown(self))

    def fail(self, reason: str, stores_lost: bool = False) -> None:
        """End the run because of an error; the server will exit non-zero.

        Args:
            reason: what went wrong (logged and kept in the summary).
            stores_lost: a shard is gone, so no final checkpoint or evaluation is possible
                (the last periodic checkpoint is the one to resume from).
        """
        log.error("%s", reason)
        self.stores_lost = self.stores_lost or stores_lost
        if not self.run.error:
            self.run.error = reason
        self.finish(f"{FAILED}{reason}")

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
