"""A worker process asked for CUDA without a GPU ends with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.errors import DeviceError
from common.training.device import resolve_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present on this machine")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda:0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "join",
            "--server",
            "tcp://127.0.0.1:9",
            "--device",
            "cuda:0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr
