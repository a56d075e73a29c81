"""Compute devices: resolving ``cpu``/``cuda:N`` and timing that respects CUDA's asynchrony."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from common.cpu_quota import own_quota_cores
from common.errors import DeviceError


def resolve_device(spec: str) -> torch.device:
    """The torch device for ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        DeviceError: CUDA was asked for but is not available, or N is out of range.
    """
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {spec} asked for CUDA, but this torch build "
                f"({torch.__version__}) sees no CUDA device; use --device cpu "
                "or install a CUDA build of torch (make setup TORCH=cuda)"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"--device {spec}: only {torch.cuda.device_count()} CUDA devices are visible"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that wall-clock timing measures the compute."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_buffer(
    numel: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A host staging buffer: pinned when the device is CUDA, so copies can be async."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


class StepTime(NamedTuple):
    """One step's compute, as measured by ``ComputeTimer``.

    Attributes:
        wall_s: wall-clock seconds the step took (CUDA: event time).
        compute_s: seconds of compute: the calling thread's CPU time on a CPU running torch on
            one thread (time the thread spent preempted by other processes is not compute), the
            wall clock with more threads or under a CPU quota (a throttled thread's CPU time
            does not grow: the quota is what makes the node slow), the event time on CUDA.
    """

    wall_s: float
    compute_s: float


class ComputeTimer:
    """Times one step's compute: CUDA events on a GPU (queued with the kernels, read after
    the end event completes), the wall clock and the thread's CPU time on a CPU.

    Args:
        device: the device the step runs on.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.quota = own_quota_cores() is not None
        self._begin = 0.0
        self._begin_cpu = 0.0
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        """Mark the start of the step."""
        if self.cuda:
            self._start.record()
        else:
            self._begin = time.perf_counter()
            self._begin_cpu = time.thread_time()

    def stop(self) -> StepTime:
        """Mark the end of the step; returns its wall and compute time."""
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            elapsed = self._start.elapsed_time(self._end) / 1000.0
            return StepTime(elapsed, elapsed)
        wall = time.perf_counter() - self._begin
        if torch.get_num_threads() > 1 or self.quota:  # other threads compute too, or the
            return StepTime(wall, wall)  # quota throttles: CPU time would miss either
        return StepTime(wall, min(time.thread_time() - self._begin_cpu, wall))
