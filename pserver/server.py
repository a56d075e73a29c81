"""The parameter server: an asyncio ZeroMQ ROUTER serving joins, tasks, pushes, data and status."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from common.dataset import DatasetReader
from common.errors import ConfigError, ErrorCode, ProtocolError, RemoteError
from common.flat import FlatLayout
from common.messages import (
    REQUESTS,
    DataReply,
    DataRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    Message,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
    error_frames,
    parse_message,
)
from common.models import build_model
from common.security import is_loopback, load_server_secret
from pserver import checkpoint
from pserver.config import ServerConfig
from pserver.errorlog import RateLimitedLog
from pserver.evaluator import Evaluator
from pserver.membership import Roster, Task, Waiter, WorkerInfo
from pserver.policies import POLICIES
from pserver.runlog import RunLog
from pserver.summary import build_summary, status_of
from pserver.trainer import Trainer, as_tensor

log = logging.getLogger(__name__)

Handler = Callable[[bytes, int, Any], Awaitable[None]]


class ParameterServer:
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
        self._error_log = RateLimitedLog(log)
        self.evals: list[dict[str, Any]] = []
        self.epochs_done = 0
        self.train_start: float | None = None
        self.train_end: float | None = None
        self.time_to_target: float | None = None
        self.finish_reason = ""
        self.address = ""
        self._finished = False
        self._done = asyncio.Event()
        self._workers_gone = asyncio.Event()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._evaluations: set[asyncio.Future[Any]] = set()
        self._next_task_id = 1
        self._started = False
        self._checkpoints = 0
        self._checkpoint_lock = asyncio.Lock()
        self._train_mask = np.zeros(meta.num_samples, dtype=bool)
        self._train_mask[self.reader.train_indices] = True
        self._data_pool = concurrent.futures.ThreadPoolExecutor(
            config.data_threads, thread_name_prefix="data"
        )
        self._eval_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eval")
        self._zmq = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._handlers: dict[type[Message], Handler] = {
            JoinRequest: self._on_join,
            TaskRequest: self._on_task_request,
            PushRequest: self._on_push,
            DataRequest: self._on_data,
            StatusRequest: self._on_status,
            HeartbeatRequest: self._on_heartbeat,
            LeaveRequest: self._on_leave,
        }
        if resumed is not None:
            checkpoint.load(self, resumed)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket; ``self.address`` is then the endpoint workers connect to."""
        sock = self._zmq.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self._secure(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, self.trainer.state_size * 8 + (16 << 20))
        bind = self.config.bind
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        sock.bind(bind)
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
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

    def _secure(self, sock: zmq.asyncio.Socket) -> None:
        """Turn on CURVE with an authenticator, or warn when serving the network in clear."""
        cfg = self.config
        if cfg.curve_secret is None or cfg.authorized_keys is None:
            if not is_loopback(cfg.bind):
                log.warning(
                    "binding %s without CURVE: anyone who reaches this port can join, read "
                    "the data and push gradients; use 'pserver keygen' and --curve-secret",
                    cfg.bind,
                )
            return
        public, secret = load_server_secret(cfg.curve_secret)
        self._auth = AsyncioAuthenticator(self._zmq)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(cfg.authorized_keys))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        log.info("CURVE on: only keys in %s may connect", cfg.authorized_keys)

    async def serve(self) -> dict[str, Any]:
        """Serve until training has ended and the workers were told to stop.

        Returns:
            The run summary (also written to ``summary.json``).
        """
        receiver = asyncio.create_task(self._receive_loop())
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
        pending = self._tasks | self._evaluations
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.roster.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._zmq.term()
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

    def _spawn(
        self, work: Awaitable[Any], bucket: set[asyncio.Future[Any]] | None = None
    ) -> asyncio.Future[Any]:
        """Run ``work`` in the background, owned by ``bucket`` (cancelled on close)."""
        owner = self._tasks if bucket is None else bucket
        task = asyncio.ensure_future(work)
        owner.add(task)
        task.add_done_callback(owner.discard)
        task.add_done_callback(_log_failure)
        return task

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        assert self._sock is not None
        self._spawn(self._sock.send_multipart([identity, *frames], copy=False))

    def _reply(self, identity: bytes, request_id: int, message: Message) -> None:
        self._send(identity, message.to_wire(request_id))

    def _reply_error(self, identity: bytes, request_id: int, code: ErrorCode, text: str) -> None:
        self._error_log.warning(
            code.name, "rejected request %d: %s: %s", request_id, code.name, text
        )
        self._send(identity, error_frames(request_id, code, text))

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            if len(frames) < 2:
                continue  # nothing but a routing id: there is no request to answer
            try:
                message, request_id = parse_message(frames[1:], REQUESTS)
            except ProtocolError as exc:
                self._reply_error(identity, exc.request_id, exc.code, str(exc))
                continue
            except RemoteError as exc:
                self._reply_error(
                    identity,
                    0,
                    ErrorCode.BAD_FIELD,
                    f"servers take requests, not error replies ({exc})",
                )
                continue
            self._spawn(self._handle(identity, request_id, message))

    async def _handle(self, identity: bytes, request_id: int, message: Message) -> None:
        try:
            await self._handlers[type(message)](identity, request_id, message)
        except ProtocolError as exc:
            self._reply_error(identity, request_id, exc.code, str(exc))
        except Exception as exc:
            log.exception("failed to handle %s", message.TYPE)
            self._reply_error(
                identity, request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            )

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
                self._evaluate_now(ledger.epoch)
        cfg = self.config
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
        self._spawn(
            self._evaluate(version, epoch, state, t, self.trainer.samples_applied),
            self._evaluations,
        )

    async def _evaluate(
        self, version: int, epoch: int, state: torch.Tensor, t: float, samples: int
    ) -> None:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        scores = await loop.run_in_executor(self._eval_pool, self.evaluator.evaluate, state.numpy())
        record = self.log.event(
            "eval",
            t=t,
            version=version,
            epoch=epoch,
            samples=samples,
            oa=scores.oa,
            aa=scores.aa,
            kappa=scores.kappa,
            loss=scores.loss,
            eval_s=round(loop.time() - begin, 4),
        )
        self.evals.append(record)
        log.info(
            "epoch %d version %d: OA %.4f AA %.4f kappa %.4f loss %.4f",
            epoch,
            version,
            scores.oa,
            scores.aa,
            scores.kappa,
            scores.loss,
        )
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
        await asyncio.gather(*self._evaluations, return_exceptions=True)
        if not self.evals or self.evals[-1]["version"] != self.trainer.version:
            self._evaluate_now(self.trainer.sampler.epoch)
            await asyncio.gather(*self._evaluations, return_exceptions=True)
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

    # --- handlers ------------------------------------------------------------------------------

    async def _on_join(self, identity: bytes, request_id: int, msg: JoinRequest) -> None:
        if self._finished:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "training has ended")
        if msg.slowdown < 1 or msg.threads < 1 or not msg.name:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"join needs slowdown >= 1, threads >= 1 and a name; got "
                f"slowdown={msg.slowdown}, threads={msg.threads}, "
                f"name={msg.name!r}",
            )
        worker = self.roster.add(msg.name, msg.device, msg.slowdown, msg.threads, self.log.now())
        name = worker.name
        self.log.event("join", worker=name, device=msg.device, slowdown=msg.slowdown)
        log.info("worker %s joined (%s, slowdown %.1f)", name, msg.device, msg.slowdown)
        channels, height, _ = self.meta.shape
        self._reply(
            identity,
            request_id,
            JoinReply(
                worker_id=worker.worker_id,
                mode=self.config.mode,
                model=self.config.model,
                in_channels=channels,
                num_classes=self.meta.num_classes,
                input_size=height,
                state_size=self.trainer.state_size,
                dataset_fingerprint=self.meta.fingerprint,
                seed=self.config.seed,
                server_id=self.server_id,
                heartbeat_s=self.config.heartbeat_s,
                dead_after_s=self.config.dead_after_s,
            ),
        )

    async def _on_task_request(self, identity: bytes, request_id: int, msg: TaskRequest) -> None:
        worker = self._member(msg.worker_id)
        if not msg.speed > 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"speed must be > 0, got {msg.speed}")
        worker.speed = msg.speed
        worker.waiter = Waiter(identity, request_id)
        if not worker.ready:
            worker.ready = True
            self.log.event("ready", worker=worker.name, speed=round(msg.speed, 3))
            if self._started:
                self.policy.on_join(worker)
            elif len(self.active_workers()) >= self.config.workers:
                self._started = True
                if self.train_start is None:  # not when resuming
                    self.train_start = self.log.now()
                self.log.event(
                    "train_start", workers=len(self.active_workers()), version=self.trainer.version
                )
                self.policy.start()
                return
        self.release()

    async def _on_push(self, identity: bytes, request_id: int, msg: PushRequest) -> None:
        worker = self._member(msg.worker_id)
        if self._finished:
            worker.waiter = Waiter(identity, request_id)
            self._send_stop(worker)
            return
        task = worker.tasks[0] if worker.tasks else None
        if task is None or msg.task_id != task.task_id or self.policy.runnable(worker) is not task:
            # Also refuses a replay of a push that is being or has been applied.
            raise ProtocolError(
                ErrorCode.WRONG_TASK, f"task {msg.task_id} is not the task this worker is running"
            )
        if msg.batch_size != task.size:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"batch_size {msg.batch_size} differs from the task's {task.size}",
            )
        if msg.state.dtype != np.float32 or msg.state.shape != (self.trainer.state_size,):
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"state must be float32 of shape ({self.trainer.state_size},), "
                f"got {msg.state.dtype} {tuple(msg.state.shape)}",
            )
        if not 0 <= msg.version <= self.trainer.version:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"version {msg.version} was never served")
        if msg.speed > 0:
            worker.speed = msg.speed
        worker.waiter = Waiter(identity, request_id)
        task.pushed = True
        try:
            await self.policy.on_push(worker, task, msg, as_tensor(msg.state))
        except BaseException as exc:
            task.pushed = False
            if isinstance(exc, ProtocolError) and exc.code == ErrorCode.NON_FINITE:
                worker.non_finite += 1
            if worker.waiter is not None and worker.waiter.request_id == request_id:
                worker.waiter = None
            raise

    async def _on_data(self, identity: bytes, request_id: int, msg: DataRequest) -> None:
        self._member(msg.worker_id)
        indices = np.asarray(msg.indices, dtype=np.int64)
        if len(indices) and (
            indices.min() < 0
            or indices.max() >= len(self._train_mask)
            or not self._train_mask[indices].all()
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, "data_request may only name indices of the training split"
            )
        loop = asyncio.get_running_loop()
        x, y = await loop.run_in_executor(self._data_pool, self.reader.read, indices)
        self._reply(identity, request_id, DataReply(x=x, y=y))

    async def _on_status(self, identity: bytes, request_id: int, msg: StatusRequest) -> None:
        self._reply(identity, request_id, StatusReply(status=status_of(self)))

    async def _on_leave(self, identity: bytes, request_id: int, msg: LeaveRequest) -> None:
        worker = self._member(msg.worker_id)
        self._reply(identity, request_id, LeaveReply())
        self._drop(worker, f"left: {msg.reason}")

    async def _on_heartbeat(self, identity: bytes, request_id: int, msg: HeartbeatRequest) -> None:
        self._member(msg.worker_id)
        self._reply(identity, request_id, HeartbeatReply(server_id=self.server_id))


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
