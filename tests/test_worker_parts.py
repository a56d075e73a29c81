"""Worker-side parts: device resolution, speed measurement and slowdown emulation."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from common.errors import ConfigError, DeviceError
from common.training.slowdown import SlowdownSchedule
from common.training.speed import SpeedMeter
from worker.device import resolve_device


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


def test_cpu_device_resolves() -> None:
    assert resolve_device("cpu").type == "cpu"


def test_speed_meter_smooths_samples_per_second() -> None:
    meter = SpeedMeter(smoothing=0.5)
    assert meter.update(100, 1.0) == 100.0
    assert meter.update(300, 1.0) == 200.0


def test_slowdown_schedule_factors_and_emulated_time() -> None:
    schedule = SlowdownSchedule(2.0, "10:3,20:1")
    assert [schedule.factor(s) for s in (0, 9, 10, 19, 20, 99)] == [2, 2, 3, 3, 1, 1]
    begin = time.perf_counter()
    assert schedule.emulate(0, 0.02) == pytest.approx(0.04)
    assert time.perf_counter() - begin >= 0.02  # it waited (F-1)*t
    assert SlowdownSchedule(4.0, "0:1").factor(0) == 1  # an explicit step-0 entry wins
    assert SlowdownSchedule(1.0, "5:3,5:2").factor(5) == 2  # so does the later of two
    for bad in ("x", "10", "10:0.5"):
        with pytest.raises(ConfigError):
            SlowdownSchedule(1.0, bad)
