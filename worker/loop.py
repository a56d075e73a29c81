"""The worker: join, calibrate, then compute gradients on the tasks the server hands out."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq
from torch import nn

from common.errors import ErrorCode, ModelError, NetworkTimeout, PSError, RemoteError, ServerLost
from common.protocol.client import Connection
from common.protocol.messages import (
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    PushRequest,
    TaskReply,
    TaskRequest,
)
from common.protocol.security import load_client_keys
from common.training.device import ComputeTimer, host_buffer, resolve_device
from common.training.flat import FlatModel
from common.training.models import BUILTIN, build_model
from common.training.slowdown import SlowdownSchedule
from common.training.speed import SpeedMeter
from worker.augment import Augmenter
from worker.config import WorkerConfig
from worker.heartbeat import TRAINING_ENDED, Heartbeat
from worker.local_data import open_local_copy
from worker.overlap import OverlappedPush
from worker.params import StoreClient
from worker.prefetch import AheadReader, Prefetcher, sample_codec

log = logging.getLogger(__name__)

# Rejections after which the worker pulls fresh parameters and recomputes (the same task after
# STALE/NON_FINITE/INCOMPLETE, whatever the server hands out after REFUSED).
RETRY_CODES = (ErrorCode.STALE, ErrorCode.NON_FINITE, ErrorCode.INCOMPLETE, ErrorCode.REFUSED)
# Rejections after which the worker joins again: the server forgot it (dropped or restarted),
# or a restarted server is busy (waiting for its parameter shards).
REJOIN_CODES = (ErrorCode.UNKNOWN_WORKER, ErrorCode.BUSY)
# A task whose loss is NaN this many times in a row is given up: the worker leaves.
MAX_NAN_TRIES = 3
CALIBRATION_STEPS = 3  # timed steps at each of the two calibration batch sizes


@dataclass
class WorkerStats:
    """What a worker did, reported when it exits."""

    steps: int = 0
    samples: int = 0
    compute_s: float = 0.0
    data_wait_s: float = 0.0
    wall_s: float = 0.0
    rejected: int = 0


class NonFiniteLoss(PSError):
    """The loss stayed NaN or infinite on the same task; the worker gives it up."""


class Worker:
    """One training process connected to one server (and its parameter shards).

    Args:
        config: a validated ``WorkerConfig``.

    Raises:
        DeviceError: the device is not available.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.timer = ComputeTimer(self.device)
        torch.set_num_threads(config.threads)
        self.context = zmq.Context()
        self.curve = (
            load_client_keys(Path(config.curve_server_key), Path(config.curve_secret))
            if config.curve_server_key and config.curve_secret
            else None
        )
        self.conn: Connection | None = None
        self.stores: StoreClient | None = None
        self.speed = SpeedMeter()
        self.slowdown = SlowdownSchedule(config.slowdown, config.slowdown_schedule)
        self.stats = WorkerStats()
        self.worker_id = 0
        self.token = ""
        self.sessions = 0
        self._joined = False
        self._ever_joined = False
        self.model: nn.Module | None = None
        self.flat: FlatModel | None = None
        self._host_state: torch.Tensor | None = None
        self._host_grad: torch.Tensor | None = None
        self._loaded_version = -1
        self._overlapped = False  # the last step's push was armed during backward
        self.overlap: OverlappedPush | None = None
        self.augmenter: Augmenter | None = None
        self._calibration: list[tuple[int, float]] = []  # (batch, compute s) of calibration

    def run(self) -> WorkerStats:
        """Join and train until the server says stop, rejoining if the server is lost.

        Returns:
            What this worker did.

        Raises:
            NetworkTimeout: the server was never reached within ``--connect-timeout``, or was
                lost for longer than ``--rejoin-timeout``.
            RemoteError: the server refused the worker.
            ModelError: the server asks for a model this worker may not import.
        """
        begin = time.perf_counter()
        lost_since: float | None = None
        log.info("connecting to %s", self.config.server)
        try:
            while True:
                try:
                    self._session()
                    break
                except (ServerLost, NetworkTimeout, RemoteError) as exc:
                    now = time.monotonic()
                    if isinstance(exc, ServerLost) and str(exc) == TRAINING_ENDED:
                        log.info("the server ended training")
                        self._leave(TRAINING_ENDED)
                        break
                    if not self._ever_joined:
                        self._not_yet_joined(exc, time.perf_counter() - begin)
                        continue
                    rejoinable = not isinstance(exc, RemoteError) or exc.code in REJOIN_CODES
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

    def _not_yet_joined(self, exc: PSError, waited_s: float) -> None:
        """Decide after a failed first join: retry (the server is busy), or give up.

        Raises:
            NetworkTimeout: nothing answered within ``--connect-timeout``.
            RemoteError: the server refused the join for good.
        """
        limit = self.config.connect_timeout_s
        if isinstance(exc, RemoteError) and exc.code != ErrorCode.BUSY:
            raise exc
        if isinstance(exc, NetworkTimeout) or waited_s >= limit:
            raise NetworkTimeout(
                f"{self.config.server} was never reached within --connect-timeout {limit:g} s"
            ) from None
        log.info("the server is not ready yet (%s); trying again", exc)
        time.sleep(min(1.0, max(limit - waited_s, 0.0)))

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
            self._joined = self._ever_joined = True
            abort = f"inproc://abort-{id(self)}-{self.sessions}"
            self.sessions += 1
            heartbeat = Heartbeat(
                self.context,
                self._connect,
                spec.worker_id,
                spec.token,
                spec.server_id,
                spec.heartbeat_s,
                spec.dead_after_s,
                abort,
            )
            self.conn.close()  # again, now listening to the heartbeat's abort channel
            self.conn = self._connect(self.config.reply_timeout_s, abort)
            heartbeat.start()
            self.stores = StoreClient(
                self.context,
                spec.shard_addresses,
                spec.shard_bounds,
                self.config.server,
                spec.chunk_elems,
                spec.wire_dtype,
                spec.worker_id,
                spec.token,
                self.curve,
                abort,
            )
            if self.config.overlap and len(self.stores.chunks) > 1:
                # With one chunk there is nothing to overlap: it is complete only when
                # backward ends, and it goes out with the push request.
                assert self.flat is not None and self._host_grad is not None
                self.overlap = OverlappedPush(self.flat, self.stores, self._host_grad)
            prefetcher = self._open_data(spec, abort)
            if self.config.augment:
                self.augmenter = Augmenter(spec.seed, noise=self.config.augment_noise)
            if self.speed.speed == 0.0:
                self._calibrate(spec)
            self._loaded_version = -1
            reply = self._request_task(calibration=True)
            while reply.action == "train":
                reply = self._step(reply, prefetcher)
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            if prefetcher is not None:
                self.stats.data_wait_s += prefetcher.wait_s
                prefetcher.close()
            if self.stores is not None:
                self.stores.close()
                self.stores = None
            self.conn.close()

    def _open_data(self, spec: JoinReply, abort: str) -> AheadReader:
        """The sample source: the --data copy if given (same fingerprint as the server's)."""
        if self.config.data is None:
            return Prefetcher(
                lambda: self._connect(self.config.data_timeout_s, abort),
                self.worker_id,
                self.token,
                sample_codec(spec),
                (spec.in_channels, spec.input_size, spec.input_size),
                self.config.cache_mb << 20,
            )
        return open_local_copy(self.config.data, spec.dataset_fingerprint)

    def _check_model_allowed(self, model: str) -> None:
        if model in BUILTIN or model in self.config.allow_model:
            return
        raise ModelError(
            f"the server asks for model {model!r}, which would import code on this worker; "
            f"start the worker with --allow-model {model} if you trust it"
        )

    def _join(self) -> JoinReply:
        assert self.conn is not None
        reply = self.conn.request(
            JoinRequest(
                name=self.config.name,
                device=str(self.device),
                slowdown=self.config.slowdown,
                threads=self.config.threads,
            ),
            timeout_s=self.config.connect_timeout_s,
            expect=JoinReply,
        )
        self._check_model_allowed(reply.model)
        self.worker_id, self.token = reply.worker_id, reply.token
        model = build_model(reply.model, reply.in_channels, reply.num_classes, reply.input_size)
        self.model = model.to(self.device).train()
        self.flat = FlatModel(self.model)
        if self.flat.size != reply.state_size or self.flat.num_params != reply.num_params:
            raise RemoteError(
                ErrorCode.BAD_TENSOR,
                f"model {reply.model} has {self.flat.size} values here but "
                f"{reply.state_size} on the server",
            )
        self._host_state = host_buffer(self.flat.size, self.device)
        self._host_grad = host_buffer(self.flat.size, self.device)
        self.overlap = None
        log.info(
            "joined %s as worker %d (%s, model %s, %d store%s, %s wire)",
            self.config.server,
            self.worker_id,
            reply.mode,
            reply.model,
            len(reply.shard_addresses),
            "" if len(reply.shard_addresses) == 1 else "s",
            reply.wire_dtype,
        )
        return reply

    def _calibrate(self, spec: JoinReply) -> None:
        """Time steps on random data at two batch sizes, so the first plan already follows
        speeds and the server's model of this worker has a slope (fixed vs per-sample cost)."""
        assert self.flat is not None
        large = self.config.calibration_batch
        size = spec.input_size
        state = self.flat.state.clone()
        pairs: list[tuple[int, float]] = []
        for batch in (max(large // 4, 1), large):
            x = torch.randn(batch, spec.in_channels, size, size, device=self.device)
            y = torch.randint(0, spec.num_classes, (batch,), device=self.device)
            for _ in range(CALIBRATION_STEPS):
                begin = self.stats.compute_s
                self._compute(x, y)
                pairs.append((batch, self.stats.compute_s - begin))
        self.flat.state.copy_(state)  # calibration must not leave BatchNorm statistics
        self._calibration = pairs[1:]  # the very first step pays one-off warm-up costs
        log.info("calibrated: %.1f samples/s", self.speed.speed)

    def _compute(self, x: torch.Tensor, y: torch.Tensor, task: TaskReply | None = None) -> float:
        """Forward and backward on one batch, then the emulated slowdown; returns the loss.

        With ``task``, gradient chunks are pushed while backward runs (on an emulated slow
        device only after its emulated step, as its slowdown is a sleep after compute); the
        rest go with the push request (``_finish_push``). A loss that is not finite skips
        backward and pushes nothing.
        """
        assert self.model is not None and self.flat is not None
        self.timer.start()
        self.flat.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        value = float(loss.detach())
        overlap = task is not None and self.overlap is not None
        overlap = overlap and self.slowdown.factor(self.stats.steps) == 1
        if math.isfinite(value):
            if overlap:
                assert self.overlap is not None and task is not None
                self.overlap.arm(task.task_id, task.push_token, task.version)
            loss.backward()
        emulated = self.slowdown.emulate(self.stats.steps, self.timer.stop())
        self.speed.update(len(y), emulated)
        self.stats.compute_s += emulated
        self._overlapped = overlap
        return value

    def _finish_push(self, task: TaskReply, overlapped: bool) -> None:
        """Send what backward did not already push, right before the push request: chunks
        and request then reach the server together and wake it once, not twice."""
        assert self.flat is not None and self.stores is not None and self._host_grad is not None
        if overlapped:
            assert self.overlap is not None
            self.overlap.finish()
            return
        self.flat.push_into(self._host_grad)
        self.stores.push(task.task_id, task.push_token, task.version, self._host_grad)

    def _request_task(self, calibration: bool = False) -> TaskReply:
        """Ask for the next task; with ``calibration`` (a session's first request), send the
        calibration pairs along."""
        assert self.conn is not None
        pairs = self._calibration if calibration else []
        request = TaskRequest(
            worker_id=self.worker_id,
            token=self.token,
            speed=self.speed.speed,
            calibration_batches=[b for b, _ in pairs] or None,
            calibration_s=[s for _, s in pairs] or None,
        )
        try:
            return self.conn.request(request, expect=TaskReply)
        except RemoteError as exc:
            if not pairs or exc.code != ErrorCode.BAD_FIELD or "unknown fields" not in str(exc):
                raise
            log.info("the server takes no calibration pairs (an older version); not sending them")
            plain = TaskRequest(worker_id=self.worker_id, token=self.token, speed=self.speed.speed)
            return self.conn.request(plain, expect=TaskReply)

    def _ensure_params(self, task: TaskReply) -> None:
        """Make sure the parameters of ``task.version`` (or newer) are loaded."""
        assert self.stores is not None and self._host_state is not None
        if self._loaded_version < task.version:
            self.stores.pull(task.version)
            self._loaded_version = self.stores.collect(
                self._host_state, self.config.reply_timeout_s
            )
        assert self.flat is not None
        self.flat.load(self._host_state)

    def _batch(self, task: TaskReply, prefetcher: AheadReader) -> tuple[torch.Tensor, torch.Tensor]:
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
        return x, y

    def _step(self, task: TaskReply, prefetcher: AheadReader) -> TaskReply:
        """Train on one task and push; returns the next task (or stop)."""
        assert self.flat is not None and self.stores is not None and self._host_grad is not None
        x, y = self._batch(task, prefetcher)
        for attempt in range(1, MAX_NAN_TRIES + 1):
            self._ensure_params(task)
            begin = self.stats.compute_s
            loss = self._compute(x, y, task)
            if math.isfinite(loss):
                break
            log.warning("loss is %s on task %d (try %d)", loss, task.task_id, attempt)
            self._loaded_version = -1  # pull the parameters again before retrying
            if attempt == MAX_NAN_TRIES:
                raise NonFiniteLoss(
                    f"the loss stayed {loss} on task {task.task_id} after {attempt} tries; "
                    "leaving so that its samples go to other workers"
                )
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
        assert self.conn is not None
        push = PushRequest(
            worker_id=self.worker_id,
            token=self.token,
            task_id=task.task_id,
            version=task.version,
            batch_size=len(task.indices),
            speed=self.speed.speed,
            compute_s=self.stats.compute_s - begin,
            transfer_s=self.stores.transfer_s,
            loss=loss,
        )
        self._finish_push(task, self._overlapped)
        try:
            reply = self.conn.request(push, expect=TaskReply)
        except RemoteError as exc:
            self._drain()
            if exc.code not in RETRY_CODES:
                raise
            self.stats.rejected += 1
            log.info("push rejected (%s); pulling fresh parameters", exc)
            self._loaded_version = -1
            return self._request_task()
        if reply.action == "train":
            try:
                assert self._host_state is not None
                self._loaded_version = self.stores.collect(
                    self._host_state, self.config.reply_timeout_s
                )
            except RemoteError as exc:
                log.info("fused parameters refused (%s); pulling them", exc)
                self._loaded_version = -1
        return reply

    def _drain(self) -> None:
        """Read the (error) answers to a rejected push's chunks, so none is left pending."""
        assert self.stores is not None and self._host_grad is not None
        with contextlib.suppress(RemoteError, NetworkTimeout):
            self.stores.collect(self._host_grad, min(self.config.reply_timeout_s, 30.0))

    def _leave(self, reason: str) -> None:
        if not self._joined:
            return
        try:
            with self._connect(2.0) as conn:
                conn.request(
                    LeaveRequest(worker_id=self.worker_id, token=self.token, reason=reason[:500]),
                    expect=LeaveReply,
                )
        except Exception as exc:  # best effort on the way out
            log.debug("leave not acknowledged: %s", exc)
