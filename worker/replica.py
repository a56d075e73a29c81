"""The model replica on a worker's device: built from the join reply, one step's compute
(forward, backward, the emulated slowdown), calibration, and moving parameters and gradients
between the device and the host buffers the parameter stores read and fill."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from common.errors import ErrorCode, RemoteError
from common.protocol.ending import FinishReason
from common.protocol.messages import JoinReply, TaskReply
from common.training.device import ComputeTimer, host_buffer
from common.training.flat import FlatModel
from common.training.models import build_model
from common.training.slowdown import SlowdownSchedule
from common.training.speed import SpeedMeter
from worker.augment import Augmenter
from worker.overlap import OverlappedPush
from worker.params import StoreClient
from worker.prefetch import AheadReader

log = logging.getLogger(__name__)

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
    finish_reason: FinishReason | None = None  # why training ended, as the server said


class Replica:
    """The server's model on this worker's device, for one membership.

    Args:
        spec: the join reply (model, input shape, state size).
        device: where the model runs.
        timer: times compute on ``device`` (CUDA events there).
        slowdown: the emulated slowdown (a sleep after compute).
        speed: the worker's speed meter, updated with every step's emulated time.
        stats: the worker's counters (``steps``, ``compute_s``).

    Raises:
        ModelError: the model cannot be built.
        RemoteError: its size differs from the server's.
    """

    def __init__(
        self,
        spec: JoinReply,
        device: torch.device,
        *,
        timer: ComputeTimer,
        slowdown: SlowdownSchedule,
        speed: SpeedMeter,
        stats: WorkerStats,
    ) -> None:
        self.device, self.timer, self.slowdown = device, timer, slowdown
        self.speed, self.stats = speed, stats
        model = build_model(spec.model, spec.in_channels, spec.num_classes, spec.input_size)
        self.model: nn.Module = model.to(device).train()
        self.flat = FlatModel(self.model)
        if self.flat.size != spec.state_size or self.flat.num_params != spec.num_params:
            raise RemoteError(
                ErrorCode.BAD_TENSOR,
                f"model {spec.model} has {self.flat.size} values here but "
                f"{spec.state_size} on the server",
            )
        on_cpu = device.type == "cpu"  # parameters are then written into the model itself
        self.host_state = self.flat.state if on_cpu else host_buffer(self.flat.size, device)
        self._written = False  # new parameters went into ``flat.state`` since the last step
        self.host_grad = host_buffer(self.flat.size, device)
        self.loaded_version = -1
        self.overlap: OverlappedPush | None = None
        self.overlapped = False  # the last step's push was armed during backward
        self.augmenter: Augmenter | None = None

    def overlap_with(self, stores: StoreClient) -> None:
        """Push gradient chunks while backward runs (when there is more than one chunk: a
        single chunk is complete only when backward ends, and goes with the push request)."""
        if len(stores.chunks) > 1:
            self.overlap = OverlappedPush(self.flat, stores, host=self.host_grad)

    def calibrate(self, spec: JoinReply, batch: int) -> list[tuple[int, float]]:
        """Time steps on random data at ``batch // 4`` and ``batch`` samples, so the first plan
        already follows speeds and the server's model of this worker has a slope.

        Returns:
            ``(batch size, compute s)`` pairs, without the very first step (warm-up costs).
        """
        size = spec.input_size
        state = self.flat.state.clone()
        pairs: list[tuple[int, float]] = []
        for n in (max(batch // 4, 1), batch):
            x = torch.randn(n, spec.in_channels, size, size, device=self.device)
            y = torch.randint(0, spec.num_classes, (n,), device=self.device)
            for _ in range(CALIBRATION_STEPS):
                begin = self.stats.compute_s
                self.compute(x, y)
                pairs.append((n, self.stats.compute_s - begin))
        self.flat.state.copy_(state)  # calibration must not leave BatchNorm statistics
        log.info("calibrated: %.1f samples/s", self.speed.speed)
        return pairs[1:]

    def compute(self, x: torch.Tensor, y: torch.Tensor, task: TaskReply | None = None) -> float:
        """Forward and backward on one batch, then the emulated slowdown; returns the loss.

        With ``task``, gradient chunks are pushed while backward runs (on an emulated slow
        device only after its emulated step, as its slowdown is a sleep after compute); the
        rest go with the push request (``finish_push``). A loss that is not finite skips
        backward and pushes nothing.
        """
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
        emulated = self.slowdown.emulate(self.stats.steps, *self.timer.stop())
        self.speed.update(len(y), emulated)
        self.stats.compute_s += emulated
        self.overlapped = overlap
        return value

    def gradient_on_host(self) -> torch.Tensor:
        """The last step's gradient (and buffer change) on the host: on a CPU the model's own
        gradient buffer (no copy; the next step zeroes it only once the push was answered),
        else copied into the host buffer."""
        if self.device.type == "cpu":
            return self.flat.push_vector()
        self.flat.push_into(self.host_grad)
        return self.host_grad

    def finish_push(self, task: TaskReply, stores: StoreClient) -> None:
        """Send what backward did not already push, right before the push request: chunks
        and request then reach the server together and wake it once, not twice."""
        if self.overlapped:
            assert self.overlap is not None
            self.overlap.finish()
            return
        stores.push(task.task_id, task.push_token, task.version, self.gradient_on_host())

    def params_buffer(self) -> torch.Tensor:
        """Where the next parameters are to be written: on a CPU the model's state itself (no
        copy to load them), else the host buffer."""
        self._written = self.host_state is self.flat.state
        return self.host_state

    def ensure_params(self, task: TaskReply, stores: StoreClient, timeout_s: float) -> None:
        """Make sure the parameters of ``task.version`` (or newer) are loaded; a version already
        in the model only gets its float buffers back (a step changes nothing else)."""
        if self.loaded_version < task.version:
            stores.pull(task.version)
            self.loaded_version = stores.collect(self.params_buffer(), timeout_s)
        if self.host_state is not self.flat.state:
            self.flat.load(self.host_state)
        elif self._written:
            self.flat.load(None)
        else:
            self.flat.reset_buffers()
        self._written = False

    def batch(self, task: TaskReply, data: AheadReader) -> tuple[torch.Tensor, torch.Tensor]:
        """The task's samples on the device (from pinned memory on CUDA), augmented if asked;
        starts prefetching the next task's."""
        x, y = data.get(task.indices)
        data.start(task.prefetch)
        if self.device.type != "cpu":
            pin = self.device.type == "cuda"
            x = (x.pin_memory() if pin else x).to(self.device, non_blocking=pin)
            y = (y.pin_memory() if pin else y).to(self.device, non_blocking=pin)
        if self.augmenter is not None:
            x = self.augmenter(x, step_key=task.task_id)
        return x, y
