"""The worker: join, calibrate, then compute gradients on the tasks the server hands out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq
from torch import nn

from common.errors import ErrorCode, NetworkTimeout, RemoteError, ServerLost
from common.protocol.client import Connection
from common.protocol.messages import (
    JoinReply,
    JoinRequest,
    LeaveRequest,
    PushRequest,
    TaskReply,
    TaskRequest,
)
from common.protocol.security import load_client_keys
from common.training.flat import FlatLayout
from common.training.models import build_model
from common.training.slowdown import SlowdownSchedule
from common.training.speed import SpeedMeter
from worker.augment import Augmenter
from worker.config import WorkerConfig
from worker.device import host_buffer, resolve_device, synchronize
from worker.heartbeat import Heartbeat
from worker.local_data import open_local_copy
from worker.prefetch import AheadReader, Prefetcher

log = logging.getLogger(__name__)

# Rejections after which the worker pulls fresh parameters and recomputes the same task.
RETRY_CODES = (ErrorCode.STALE, ErrorCode.NON_FINITE)
# Rejections after which the worker joins again (the server forgot it: dropped or restarted).
REJOIN_CODES = (ErrorCode.UNKNOWN_WORKER,)


@dataclass
class WorkerStats:
    """What a worker did, reported when it exits."""

    steps: int = 0
    samples: int = 0
    compute_s: float = 0.0
    data_wait_s: float = 0.0
    wall_s: float = 0.0
    rejected: int = 0


class Worker:
    """One training process connected to one server.

    Args:
        config: a validated ``WorkerConfig``.

    Raises:
        DeviceError: the device is not available.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        torch.set_num_threads(config.threads)
        self.context = zmq.Context()
        self.curve = (
            load_client_keys(Path(config.curve_server_key), Path(config.curve_secret))
            if config.curve_server_key and config.curve_secret
            else None
        )
        self.conn: Connection | None = None
        self.speed = SpeedMeter()
        self.slowdown = SlowdownSchedule(config.slowdown, config.slowdown_schedule)
        self.stats = WorkerStats()
        self.worker_id = 0
        self.sessions = 0
        self._joined = False
        self.model: nn.Module | None = None
        self.layout: FlatLayout | None = None
        self._host_state: torch.Tensor | None = None
        self.augmenter: Augmenter | None = None

    def run(self) -> WorkerStats:
        """Join and train until the server says stop, rejoining if the server is lost.

        Returns:
            What this worker did.

        Raises:
            NetworkTimeout, ServerLost: the server stayed away longer than the rejoin timeout.
            RemoteError: the server refused the worker.
        """
        begin = time.perf_counter()
        lost_since: float | None = None
        try:
            while True:
                try:
                    self._session()
                    break
                except (ServerLost, NetworkTimeout, RemoteError) as exc:
                    rejoinable = not isinstance(exc, RemoteError) or exc.code in REJOIN_CODES
                    now = time.monotonic()
                    if self._joined or lost_since is None:
                        lost_since = now  # the server was there until now
                    self._joined = False
                    if not rejoinable or now - lost_since > self.config.rejoin_timeout_s:
                        raise
                    log.warning("lost the server (%s); rejoining", exc)
        except KeyboardInterrupt:
            self._leave("interrupted")
            raise
        except Exception as exc:  # a crash in training: free our samples at once
            self._leave(f"failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self.stats.wall_s = time.perf_counter() - begin
            self.context.term()
        log.info(
            "worker %s done: %d steps, %d samples, data wait %.1f%% of wall time",
            self.config.name,
            self.stats.steps,
            self.stats.samples,
            100 * self.stats.data_wait_s / max(self.stats.wall_s, 1e-9),
        )
        return self.stats

    def _connect(self, timeout_s: float, abort: str | None = None) -> Connection:
        """A new connection to the server in this worker's context, with its CURVE keys."""
        return Connection(
            self.config.server, timeout_s, self.context, abort=abort, curve=self.curve
        )

    def _session(self) -> None:
        """One membership: join, (calibrate), train until stop."""
        self.conn = self._connect(self.config.reply_timeout_s)
        heartbeat: Heartbeat | None = None
        prefetcher: AheadReader | None = None
        try:
            spec = self._join()
            self._joined = True
            abort = f"inproc://abort-{id(self)}-{self.sessions}"
            self.sessions += 1
            heartbeat = Heartbeat(
                self.context,
                self._connect,
                spec.worker_id,
                spec.server_id,
                spec.heartbeat_s,
                spec.dead_after_s,
                abort,
            )
            self.conn.close()  # again, now listening to the heartbeat's abort channel
            self.conn = self._connect(self.config.reply_timeout_s, abort)
            heartbeat.start()
            prefetcher = self._open_data(spec, abort)
            if self.config.augment:
                self.augmenter = Augmenter(spec.seed, noise=self.config.augment_noise)
            if self.speed.speed == 0.0:
                self._calibrate(spec)
            reply = self._request_task()
            while reply.action == "train":
                reply = self._step(reply, prefetcher)
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            if prefetcher is not None:
                self.stats.data_wait_s += prefetcher.wait_s
                prefetcher.close()
            self.conn.close()

    def _open_data(self, spec: JoinReply, abort: str) -> AheadReader:
        """The sample source: the --data copy if given (same fingerprint as the server's)."""
        if self.config.data is None:
            return Prefetcher(
                lambda: self._connect(self.config.data_timeout_s, abort), self.worker_id
            )
        return open_local_copy(self.config.data, spec.dataset_fingerprint)

    def _join(self) -> JoinReply:
        reply = self.conn.request(
            JoinRequest(
                name=self.config.name,
                device=str(self.device),
                slowdown=self.config.slowdown,
                threads=self.config.threads,
            ),
            timeout_s=self.config.join_timeout_s,
        )
        assert isinstance(reply, JoinReply)
        self.worker_id = reply.worker_id
        self.model = (
            build_model(reply.model, reply.in_channels, reply.num_classes, reply.input_size)
            .to(self.device)
            .train()
        )
        self.layout = FlatLayout(self.model)
        if self.layout.size != reply.state_size:
            raise RemoteError(
                ErrorCode.BAD_TENSOR,
                f"model {reply.model} has {self.layout.size} values here but "
                f"{reply.state_size} on the server",
            )
        self._host_state = host_buffer(self.layout.size, self.device)
        log.info(
            "joined %s as worker %d (%s, model %s)",
            self.config.server,
            self.worker_id,
            reply.mode,
            reply.model,
        )
        return reply

    def _calibrate(self, spec: JoinReply) -> None:
        """Time a few steps on random data so the first plan already follows speeds."""
        batch = self.config.calibration_batch
        x = torch.randn(
            batch, spec.in_channels, spec.input_size, spec.input_size, device=self.device
        )
        y = torch.randint(0, spec.num_classes, (batch,), device=self.device)
        state = self.layout.read_state()
        for _ in range(3):
            self._compute(x, y)
        self.layout.write_state(state)  # calibration must not leave BatchNorm statistics
        log.info("calibrated: %.1f samples/s", self.speed.speed)

    def _compute(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward on one batch, then the emulated slowdown; returns the loss."""
        assert self.model is not None
        synchronize(self.device)
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        synchronize(self.device)
        emulated = self.slowdown.emulate(self.stats.steps, time.perf_counter() - start)
        self.speed.update(len(y), emulated)
        self.stats.compute_s += emulated
        return float(loss.detach())

    def _request_task(self) -> TaskReply:
        reply = self.conn.request(TaskRequest(worker_id=self.worker_id, speed=self.speed.speed))
        assert isinstance(reply, TaskReply)
        return reply

    def _load(self, params: np.ndarray) -> torch.Tensor:
        """Load served parameters; returns the float buffers as loaded (for their change)."""
        assert self.layout is not None and self._host_state is not None
        self._host_state.copy_(torch.from_numpy(params))
        self.layout.write_state(self._host_state)
        return self.layout.read_buffers()

    def _step(self, task: TaskReply, prefetcher: AheadReader) -> TaskReply:
        buffers_before = self._load(task.params)
        x_np, y_np = prefetcher.get(task.indices)
        prefetcher.start(task.prefetch)
        pin = self.device.type == "cuda"
        x = torch.from_numpy(np.ascontiguousarray(x_np))
        y = torch.from_numpy(np.ascontiguousarray(y_np))
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        x = x.to(self.device, non_blocking=pin)
        y = y.to(self.device, non_blocking=pin)
        if self.augmenter is not None:
            x = self.augmenter(x, step_key=task.task_id)
        begin = self.stats.compute_s
        loss = self._compute(x, y)
        assert self.layout is not None
        update = self.layout.read_push(buffers_before)
        self.stats.steps += 1
        self.stats.samples += len(task.indices)
        if self.stats.steps % self.config.log_every == 0:
            log.info(
                "step %d epoch %d version %d: loss %.4f, %.1f samples/s",
                self.stats.steps,
                task.epoch,
                task.version,
                loss,
                self.speed.speed,
            )
        push = PushRequest(
            worker_id=self.worker_id,
            task_id=task.task_id,
            version=task.version,
            batch_size=len(task.indices),
            speed=self.speed.speed,
            compute_s=self.stats.compute_s - begin,
            loss=loss,
            state=update.numpy(),
        )
        try:
            reply = self.conn.request(push)
        except RemoteError as exc:
            if exc.code not in RETRY_CODES:
                raise
            self.stats.rejected += 1
            log.info("push rejected (%s); pulling fresh parameters", exc)
            reply = self._request_task()
        assert isinstance(reply, TaskReply)
        return reply

    def _leave(self, reason: str) -> None:
        if not self._joined:
            return
        try:
            with self._connect(2.0) as conn:
                conn.request(LeaveRequest(worker_id=self.worker_id, reason=reason))
        except Exception as exc:  # best effort on the way out
            log.debug("leave not acknowledged: %s", exc)
