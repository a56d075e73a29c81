"""The parameter server: an asyncio ZeroMQ ROUTER serving joins, tasks, pushes, data and status."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from collections.abc import Awaitable
from typing import Any

import numpy as np
import torch

from common.data.dataset import DatasetReader
from common.errors import ConfigError, ErrorCode, ProtocolError
from common.protocol.messages import (
    Message,
    TaskReply,
)
from common.training.evaluator import Evaluator, lower_thread_priority, record_evaluation
from common.training.flat import FlatLayout
from common.training.models import build_model
from common.training.runlog import RunLog
from pserver import checkpoint
from pserver.config import ServerConfig
from pserver.handlers import RequestHandlers
from pserver.membership import Roster, Task, WorkerInfo
from pserver.policies import POLICIES
from pserver.summary import build_summary
from pserver.trainer import Trainer
from pserver.transport import Endpoint, TaskOwner

log = logging.getLogger(__name__)


class ParameterServer(RequestHandlers):
    """Holds the model state and serves workers until training ends.

    Use as ``async with ParameterServer(cfg) as ps: summary = await ps.serve()``.

    Args:
        config: a validated ``ServerConfig``.

    Raises:
        DatasetError, ModelError: the dataset or model cannot be loaded.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        resumed = None
        if config.resume:
            assert config.run_dir is not None
            path = checkpoint.latest(config.run_dir / "checkpoints")
            if path is None:
                raise ConfigError(f"--resume: no checkpoint in {config.run_dir / 'checkpoints'}")
            resumed = checkpoint.read(path)
        self.log = RunLog(config.run_dir, resume_at=resumed.meta["t"] if resumed else None)
        self.reader = DatasetReader(config.dataset, cache_bytes=config.cache_mb << 20)
        meta = self.reader.meta
        self.meta = meta
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        channels, height, _ = meta.shape
        model = build_model(config.model, channels, meta.num_classes, height)
        layout = FlatLayout(model)
        self.trainer = Trainer(
            config, layout.read_state(), layout.num_params, len(self.reader.train_indices)
        )
        self.evaluator = Evaluator(model, self.reader, meta.num_classes, config.eval_batch)
        self.policy = POLICIES[config.mode](self)
        self.roster = Roster(config.dead_after_s, self._on_dead)
        self.server_id = secrets.token_hex(8)
        self.evals: list[dict[str, Any]] = []
        self.epochs_done = 0
        self.train_start: float | None = None
        self.train_end: float | None = None
        self.time_to_target: float | None = None
        self.finish_reason = ""
        self.summary: dict[str, Any] = {}
        self.address = ""
        self.http: Any = None  # the status page (pserver.statuspage), with --http
        self._finished = False
        self._done = asyncio.Event()
        self._workers_gone = asyncio.Event()
        self.tasks = TaskOwner()
        self._evaluations = TaskOwner()
        self._next_task_id = 1
        self._started = False
        self._checkpoints = 0
        self._checkpoint_lock = asyncio.Lock()
        self._train_mask = np.zeros(meta.num_samples, dtype=bool)
        self._train_mask[self.reader.train_indices] = True
        self._data_pool = concurrent.futures.ThreadPoolExecutor(
            config.data_threads, thread_name_prefix="data"
        )
        self._eval_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="eval", initializer=lower_thread_priority
        )
        self.endpoint = Endpoint(
            config.bind,
            self.trainer.state_size * 8 + (16 << 20),
            self.tasks,
            config.curve_secret,
            config.authorized_keys,
        )
        if resumed is not None:
            checkpoint.load(self, resumed)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket; ``self.address`` is then the endpoint workers connect to."""
        if self.config.http_port is not None:
            from pserver.statuspage import start_for_server

            self.http = await start_for_server(self)
        self.address = self.endpoint.bind()
        # Load the sample cache (if the data fits) while workers start, not on the first pull.
        warm = self.reader.train_indices[:1]
        self._spawn(
            asyncio.get_running_loop().run_in_executor(self._data_pool, self.reader.read, warm)
        )
        self.log.event(
            "start",
            address=self.address,
            mode=self.config.mode,
            model=self.config.model,
            dataset=str(self.config.dataset),
            state_size=self.trainer.state_size,
            train=len(self.reader.train_indices),
            test=len(self.reader.test_indices),
        )
        log.info(
            "serving %s on %s (%d parameters and buffers, %d training samples)",
            self.config.mode,
            self.address,
            self.trainer.state_size,
            len(self.reader.train_indices),
        )

    async def serve(self) -> dict[str, Any]:
        """Serve until training has ended and the workers were told to stop.

        Returns:
            The run summary (also written to ``summary.json``).
        """
        receiver = asyncio.create_task(self.endpoint.receive_loop(self.dispatch))
        try:
            await self._done.wait()
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return self.summary

    def request_stop(self) -> None:
        """End training now (signals call this); shutdown then proceeds within its timeout."""
        self.finish("stopped")

    async def close(self) -> None:
        """Cancel outstanding tasks, close the socket and release the dataset."""
        if self.http is not None:
            await self.http.close()
        await self._evaluations.cancel_all()
        await self.tasks.cancel_all()
        self.roster.close()
        self.endpoint.close()
        self.trainer.close()
        self._data_pool.shutdown(wait=True, cancel_futures=True)
        self._eval_pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()
        self.log.close()

    async def __aenter__(self) -> ParameterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- plumbing ----------------------------------------------------------------------------

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``work`` in the background, owned by the server (cancelled on close)."""
        return self.tasks.spawn(work)

    def _reply(self, identity: bytes, request_id: int, message: Message) -> None:
        self.endpoint.reply(identity, request_id, message)

    def _member(self, worker_id: int) -> WorkerInfo:
        """The active member with this id (its liveness deadline restarts)."""
        worker = self.roster.workers.get(worker_id)
        if worker is None or not worker.active:
            raise ProtocolError(
                ErrorCode.UNKNOWN_WORKER, f"worker id {worker_id} is not a member; join first"
            )
        self.roster.touch(worker)
        return worker

    def _drop(self, worker: WorkerInfo, reason: str) -> None:
        """Remove a worker that left or died; its unfinished samples go back to the pool."""
        self.roster.remove(worker)
        self.log.event("leave", worker=worker.name, reason=reason[:200])
        log.info("worker %s is gone: %s", worker.name, reason)
        self._spawn(self.policy.on_leave(worker))
        if not self.members():
            self._workers_gone.set()

    def _on_dead(self, worker: WorkerInfo) -> None:
        self._drop(worker, f"dead: silent for {self.config.dead_after_s:g} s")

    # --- services to the policies (PolicyContext) -------------------------------------------

    @property
    def finished(self) -> bool:
        """Training has ended."""
        return self._finished

    @property
    def started(self) -> bool:
        """Enough workers were ready and the policy planned its first tasks."""
        return self._started

    def members(self) -> list[WorkerInfo]:
        """Workers that joined and have neither left nor been stopped, in join order."""
        return self.roster.members()

    def active_workers(self) -> list[WorkerInfo]:
        """Members that have calibrated and take tasks, in join order."""
        return self.roster.ready()

    def new_task(
        self, worker: WorkerInfo, epoch: int, positions: np.ndarray, round_id: int = -1
    ) -> Task:
        """Create a task over training-split ``positions`` and queue it on ``worker``."""
        indices = self.reader.train_indices[positions].tolist()
        task = Task(self._next_task_id, epoch, positions, indices, round_id)
        self._next_task_id += 1
        worker.tasks.append(task)
        return task

    def release(self) -> None:
        """Answer each waiting worker with its runnable task, or with stop once training ended."""
        version, state = self.trainer.snapshot
        params = state.numpy()
        for worker in self.members():
            waiter = worker.waiter
            if waiter is None:
                continue
            if self._finished:
                self._send_stop(worker)
                continue
            task = self.policy.runnable(worker)
            if task is None:
                continue
            hint = self.policy.prefetch_hint(worker)
            worker.waiter = None
            self._reply(
                waiter.identity,
                waiter.request_id,
                TaskReply(
                    action="train",
                    task_id=task.task_id,
                    version=version,
                    epoch=task.epoch,
                    indices=task.indices,
                    prefetch=hint.indices if hint else [],
                    params=params,
                ),
            )

    def _send_stop(self, worker: WorkerInfo) -> None:
        waiter = worker.waiter
        self.roster.remove(worker)
        if waiter is not None:
            self._reply(
                waiter.identity,
                waiter.request_id,
                TaskReply(
                    action="stop",
                    task_id=0,
                    version=self.trainer.version,
                    epoch=0,
                    indices=[],
                    prefetch=[],
                    params=np.zeros(0, dtype=np.float32),
                ),
            )
        self.log.event("leave", worker=worker.name, reason="stop")
        if not self.members():
            self._workers_gone.set()

    def account(self, done: list[tuple[WorkerInfo, Task]]) -> None:
        """Book applied tasks; start evaluations at epoch ends; stop when a limit is hit."""
        cfg = self.config
        sampler = self.trainer.sampler
        for worker, task in done:
            worker.samples += task.size
            worker.pushes += 1
            ledger = sampler.record_applied(task.epoch, task.positions)
            if ledger.complete:
                exactly_once = bool((ledger.uses == 1).all())
                self.log.event(
                    "epoch",
                    epoch=ledger.epoch,
                    samples=ledger.applied,
                    exactly_once=exactly_once,
                    version=self.trainer.version,
                )
                if not exactly_once:
                    log.error("epoch %d did not use every sample exactly once", ledger.epoch)
                sampler.forget(ledger.epoch)
                self.epochs_done = max(self.epochs_done, ledger.epoch)
                if ledger.epoch % cfg.eval_every == 0:
                    self._evaluate_now(ledger.epoch)
        every = cfg.checkpoint_every
        if every and self.trainer.steps // every > self._checkpoints:
            self._checkpoints = self.trainer.steps // every
            self._spawn(self.save_checkpoint())
        if cfg.max_steps is not None and self.trainer.steps >= cfg.max_steps:
            self.finish("max_steps")
        elif sampler.exhausted and not sampler.ledgers:
            self.finish("epochs")

    # --- evaluation and the end of training -------------------------------------------------

    def _evaluate_now(self, epoch: int) -> None:
        version, state = self.trainer.snapshot
        t = self.log.now()
        self._evaluations.spawn(
            self._evaluate(version, epoch, state, t, self.trainer.samples_applied)
        )

    async def _evaluate(
        self, version: int, epoch: int, state: torch.Tensor, t: float, samples: int
    ) -> None:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        scores = await loop.run_in_executor(self._eval_pool, self.evaluator.evaluate, state.numpy())
        record = record_evaluation(
            self.log,
            scores,
            t=t,
            version=version,
            epoch=epoch,
            samples=samples,
            eval_s=loop.time() - begin,
        )
        self.evals.append(record)
        target = self.config.target_oa
        if target is not None and scores.oa >= target and self.time_to_target is None:
            self.time_to_target = t - (self.train_start or 0.0)
            self.finish("target_oa")

    def finish(self, reason: str) -> None:
        """End training: no more tasks; waiting workers are told to stop."""
        if self._finished:
            return
        self._finished = True
        self.finish_reason = reason
        self.train_end = self.log.now()
        log.info("training finished (%s) at version %d", reason, self.trainer.version)
        self.release()
        self._spawn(self._shutdown())

    async def save_checkpoint(self) -> None:
        """Write a checkpoint now (one at a time)."""
        async with self._checkpoint_lock:
            await checkpoint.save(self)

    async def _shutdown(self) -> None:
        if self.config.run_dir is not None:
            await self.save_checkpoint()
        await self._evaluations.wait()
        if not self.evals or self.evals[-1]["version"] != self.trainer.version:
            self._evaluate_now(self.trainer.sampler.epoch)
            await self._evaluations.wait()
        if not self.members():
            self._workers_gone.set()
        try:
            await asyncio.wait_for(self._workers_gone.wait(), self.config.shutdown_timeout_s)
        except TimeoutError:
            log.warning(
                "%d workers did not collect their stop within %.0f s",
                len(self.members()),
                self.config.shutdown_timeout_s,
            )
        self.summary = build_summary(self)
        self.log.write_summary(self.summary)
        self._done.set()
