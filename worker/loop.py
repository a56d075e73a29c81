"""The worker: join, calibrate, then compute gradients on the tasks the server hands out,
rejoining a lost server. The model itself (compute, calibration, parameter and gradient
buffers) is the ``Replica`` of ``worker.replica``."""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from common import stagetrace
from common.errors import (
    ErrorCode,
    NetworkTimeout,
    ProtocolError,
    PSError,
    RemoteError,
    RunFailed,
    ServerLost,
)
from common.protocol.client import Connection
from common.protocol.ending import RunEnded
from common.protocol.messages import (
    GradientPushRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    PushRequest,
    TaskParamsReply,
    TaskReply,
    TaskRequest,
)
from common.protocol.security import load_client_keys
from common.training.device import ComputeTimer, resolve_device
from common.training.models import check_allowed
from common.training.slowdown import SlowdownSchedule
from common.training.speed import SpeedMeter
from worker.augment import Augmenter
from worker.config import WorkerConfig
from worker.heartbeat import Heartbeat
from worker.local_data import open_local_copy
from worker.params import StoreClient
from worker.prefetch import AheadReader, Prefetcher, sample_codec
from worker.replica import Replica, WorkerStats

log = logging.getLogger(__name__)

# Rejections after which the worker pulls fresh parameters and recomputes (the same task after
# STALE/NON_FINITE/INCOMPLETE, whatever the server hands out after REFUSED).
RETRY_CODES = (ErrorCode.STALE, ErrorCode.NON_FINITE, ErrorCode.INCOMPLETE, ErrorCode.REFUSED)
# Rejections after which the worker joins again: the server forgot it (dropped or restarted),
# its task was withdrawn when it was dropped (a push that arrives after the drop), or a
# restarted server is busy (waiting for its parameter shards).
REJOIN_CODES = (ErrorCode.UNKNOWN_WORKER, ErrorCode.WRONG_TASK, ErrorCode.BUSY)
# A task whose loss is NaN this many times in a row is given up: the worker leaves.
MAX_NAN_TRIES = 3


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
        stagetrace.start("worker")
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
        self.replica: Replica | None = None
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
            RunFailed: the server ended the run because of a failure (a lost shard).
        """
        begin = time.perf_counter()
        lost_since: float | None = None
        log.info("connecting to %s", self.config.server)
        try:
            while True:
                try:
                    ended = self._session()
                    break
                except RunEnded as exc:  # heartbeats said so: free our samples at once
                    log.info("the server ended training")
                    self._leave(str(exc))
                    ended = exc
                    break
                except (ServerLost, NetworkTimeout, RemoteError) as exc:
                    now = time.monotonic()
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
        self.stats.finish_reason = ended.reason
        log.info(
            "worker %s: %s after %d steps, %d samples, data wait %.1f%% of wall time",
            self.config.name,
            ended.reason.words,
            self.stats.steps,
            self.stats.samples,
            100 * self.stats.data_wait_s / max(self.stats.wall_s, 1e-9),
        )
        if ended.failure:
            raise RunFailed(f"{ended} (after {self.stats.steps} steps)")
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
            self.config.server, timeout_s, context=self.context, abort=abort, curve=self.curve
        )

    def _session(self) -> RunEnded:
        """One membership: join, (calibrate), train until stop.

        Returns:
            The end the stop reply tells.

        Raises:
            RunEnded: the heartbeats said training has ended while the worker waited.
        """
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
                worker_id=spec.worker_id,
                token=spec.token,
                server_id=spec.server_id,
                interval_s=spec.heartbeat_s,
                dead_after_s=spec.dead_after_s,
                abort=abort,
            )
            self.conn.close()  # again, now listening to the heartbeat's abort channel
            self.conn = self._connect(self.config.reply_timeout_s, abort)
            heartbeat.start()
            self.stores = StoreClient(
                self.context, spec, coordinator=self.config.server, curve=self.curve, abort=abort
            )
            replica = self.replica
            assert replica is not None
            replica.overlap_with(self.stores)
            prefetcher = self._open_data(spec, abort)
            if self.config.augment:
                replica.augmenter = Augmenter(spec.seed, noise=self.config.augment_noise)
            if self.speed.speed == 0.0:
                self._calibration = replica.calibrate(spec, self.config.calibration_batch)
            reply = self._request_task(calibration=True)
            while reply.action == "train":
                reply = self._step(reply, prefetcher)
            if reply.finish_reason is None:
                raise ProtocolError(ErrorCode.BAD_FIELD, "task_reply: a stop without finish_reason")
            return RunEnded(reply.finish_reason, reply.failure)
        except ServerLost:
            if heartbeat is not None and heartbeat.ended is not None:
                raise heartbeat.ended from None
            raise
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
                token=self.token,
                codec=sample_codec(spec),
                shape=(spec.in_channels, spec.input_size, spec.input_size),
                num_classes=spec.num_classes,
                cache_bytes=self.config.cache_mb << 20,
            )
        return open_local_copy(self.config.data, spec.dataset_fingerprint)

    def _join(self) -> JoinReply:
        assert self.conn is not None
        request = JoinRequest(
            name=self.config.name,
            device=str(self.device),
            slowdown=self.config.slowdown,
            threads=self.config.threads,
            torch_version=torch.__version__,
            host=socket.gethostname(),
        )
        timeout_s = self.config.connect_timeout_s
        reply = self.conn.request(request, timeout_s=timeout_s, expect=JoinReply)
        check_allowed(reply.model, self.config.allow_model, "the server")
        self.worker_id, self.token = reply.worker_id, reply.token
        self.replica = Replica(
            reply,
            self.device,
            timer=self.timer,
            slowdown=self.slowdown,
            speed=self.speed,
            stats=self.stats,
        )
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
        return self.conn.request(request, expect=TaskReply)

    def _step(self, task: TaskReply, prefetcher: AheadReader) -> TaskReply:
        """Train on one task and push; returns the next task (or stop)."""
        replica, stores = self.replica, self.stores
        assert replica is not None and stores is not None
        stagetrace.mark("w_task", task=task.task_id, version=task.version)
        x, y = replica.batch(task, prefetcher)
        for attempt in range(1, MAX_NAN_TRIES + 1):
            replica.ensure_params(task, stores, self.config.reply_timeout_s)
            begin = self.stats.compute_s
            stagetrace.mark("w_compute", task=task.task_id)
            loss = replica.compute(x, y, task)
            stagetrace.mark("w_computed", task=task.task_id)
            if math.isfinite(loss):
                break
            log.warning("loss is %s on task %d (try %d)", loss, task.task_id, attempt)
            replica.loaded_version = -1  # pull the parameters again before retrying
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
        fields: dict[str, Any] = dict(
            worker_id=self.worker_id,
            token=self.token,
            task_id=task.task_id,
            version=task.version,
            batch_size=len(task.indices),
            speed=self.speed.speed,
            compute_s=self.stats.compute_s - begin,
            transfer_s=stores.transfer_s,
            loss=loss,
        )
        push: PushRequest
        if stores.whole_on_coordinator:  # one message each way: the gradient goes inside
            gradient, scale = stores.encode_whole(replica.gradient_on_host())
            push = GradientPushRequest(
                **fields, push_token=task.push_token, scale=scale, gradient=gradient
            )
        else:
            push = PushRequest(**fields)
            replica.finish_push(task, stores)
        stagetrace.mark("w_push", task=task.task_id)
        try:
            reply = self.conn.request(push, expect=TaskReply)
            stagetrace.mark("w_reply", task=task.task_id)
        except RemoteError as exc:
            if not stores.whole_on_coordinator:
                self._drain()
            if exc.code not in RETRY_CODES:
                raise
            self.stats.rejected += 1
            log.info("push rejected (%s); pulling fresh parameters", exc)
            replica.loaded_version = -1
            return self._request_task()
        if isinstance(reply, TaskParamsReply):
            replica.loaded_version = stores.load_whole(reply, replica.params_buffer())
            stagetrace.mark("w_params", task=task.task_id, version=replica.loaded_version)
        elif reply.action == "train" and reply.version == replica.loaded_version:
            pass  # the round goes on (a task taken over from a worker that left): the chunks'
            # answers come when it closes, and the next push or pull stops waiting for them
        elif reply.action == "train" and not stores.whole_on_coordinator:
            try:
                replica.loaded_version = stores.collect(
                    replica.params_buffer(), self.config.reply_timeout_s
                )
                stagetrace.mark("w_params", task=task.task_id, version=replica.loaded_version)
            except RemoteError as exc:
                log.info("fused parameters refused (%s); pulling them", exc)
                replica.loaded_version = -1
        return reply

    def _drain(self) -> None:
        """Read the (error) answers to a rejected push's chunks, so none is left pending."""
        assert self.stores is not None and self.replica is not None
        with contextlib.suppress(RemoteError, NetworkTimeout):
            self.stores.collect(self.replica.host_grad, min(self.config.reply_timeout_s, 30.0))

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
