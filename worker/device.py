"""Compute devices: resolving ``cpu``/``cuda:N`` and timing that respects CUDA's asynchrony."""

from __future__ import annotations

import torch

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
