"""Worker-side parts: device resolution, speed measurement and slowdown emulation."""

from __future__ import annotations

import math
import time

import pytest
import torch

from common.errors import ConfigError
from common.training.device import ComputeTimer, resolve_device
from common.training.models import build_model
from common.training.perfmodel import HUBER_K, MIN_NOISE
from common.training.slowdown import SlowdownSchedule
from common.training.speed import SpeedMeter


def test_cpu_device_resolves() -> None:
    assert resolve_device("cpu").type == "cpu"


def test_speed_meter_ignores_a_stall_and_follows_a_lasting_change() -> None:
    meter = SpeedMeter(smoothing=0.5)
    assert meter.update(100, 1.0) == 100.0
    clip = HUBER_K * MIN_NOISE  # a step far off moves the speed by at most this log ratio
    meter.update(100, 10.0)  # one step 10x slower: beyond 4 sigmas (a run of one)
    assert meter.speed == pytest.approx(100 * math.exp(-0.5 * clip), rel=1e-3)
    meter.update(100, 1.0)  # as before: the run is over, the speed half-way back
    assert meter.speed == pytest.approx(100 * math.exp(-0.25 * clip), rel=1e-3)
    level = meter.speed
    for _ in range(3):  # now 4x slower: the third such step is a change point
        meter.update(100, 4.0)
    # the run's ratios: 4 / (100 / speed) at the speeds before each (the first two clipped);
    # their median is the second's, and the speed is divided by it after the third step
    second = level * math.exp(-0.5 * clip)
    assert meter.speed == pytest.approx(second * math.exp(-0.5 * clip) / (4 * second / 100))
    assert meter.shift.found == 1


def test_slowdown_schedule_factors_and_emulated_time() -> None:
    schedule = SlowdownSchedule(2.0, "10:3,20:1")
    assert [schedule.factor(s) for s in (0, 9, 10, 19, 20, 99)] == [2, 2, 3, 3, 1, 1]
    begin = time.perf_counter()
    assert schedule.emulate(0, 0.03, 0.02) == pytest.approx(0.05)  # wall t + (F-1)*compute
    assert time.perf_counter() - begin >= 0.02  # it waited (F-1)*compute
    assert SlowdownSchedule(4.0, "0:1").factor(0) == 1  # an explicit step-0 entry wins
    assert SlowdownSchedule(1.0, "5:3,5:2").factor(5) == 2  # so does the later of two
    for bad in ("x", "10", "10:0.5"):
        with pytest.raises(ConfigError):
            SlowdownSchedule(1.0, bad)


def test_compute_time_leaves_out_time_off_the_cpu() -> None:
    # A CPU step's compute is its thread's CPU time: time spent off the core (here a sleep;
    # on a shared machine, other processes running) is wall time, never scaled by a slowdown.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timer = ComputeTimer(torch.device("cpu"))
        timer.start()
        cpu_begin, give_up = time.thread_time(), time.perf_counter() + 5.0
        while time.thread_time() - cpu_begin < 0.02 and time.perf_counter() < give_up:
            pass
        time.sleep(0.05)
        spent = timer.stop()
    finally:
        torch.set_num_threads(threads)
    assert spent.wall_s >= 0.07
    assert 0.02 <= spent.compute_s <= 0.045  # the 0.05 s asleep is not compute


class _RecordingStores:
    """Stands in for StoreClient: records which chunks were sent, when, with what values."""

    def __init__(self, size: int, chunk: int) -> None:
        self.chunks = [(a, min(a + chunk, size)) for a in range(0, size, chunk)]
        self.sent: dict[int, torch.Tensor] = {}
        self.order: list[int] = []
        self.during_backward: list[int] = []
        self.in_backward = False

    def begin_push(self, task_id: int, push_token: str, version: int) -> None:
        self.sent.clear()

    def send_chunk(self, index: int, values: torch.Tensor) -> None:
        self.sent[index] = values.clone()
        self.order.append(index)
        if self.in_backward:
            self.during_backward.append(index)

    def unsent(self) -> list[int]:
        return [j for j in range(len(self.chunks)) if j not in self.sent]


def test_chunks_pushed_during_backward_equal_the_whole_push() -> None:
    from common.training.flat import FlatModel
    from worker.overlap import OverlappedPush

    torch.manual_seed(0)
    model = build_model("hsi-cnn", in_channels=8, num_classes=3, input_size=5).train()
    flat = FlatModel(model)
    stores = _RecordingStores(flat.size, 2048)
    host = torch.zeros(flat.size)
    overlap = OverlappedPush(flat, stores, host=host)  # type: ignore[arg-type]
    x, y = torch.randn(16, 8, 5, 5), torch.randint(0, 3, (16,))
    flat.load(flat.state.clone())
    flat.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    overlap.arm(1, "token", 0)
    stores.in_backward = True
    loss.backward()
    stores.in_backward = False
    overlap.finish()
    whole = torch.empty(flat.size)
    flat.push_into(whole)
    assert sorted(stores.sent) == list(range(len(stores.chunks)))
    for j, (a, b) in enumerate(stores.chunks):
        assert torch.equal(stores.sent[j], whole[a:b])
    # backward finishes the last layers first: most chunks left during backward, from the end
    assert len(stores.during_backward) >= len(stores.chunks) // 2
    params_done = [j for j in stores.during_backward if stores.chunks[j][0] < flat.num_params]
    assert params_done[0] > params_done[-1]


def test_a_worker_name_is_one_plain_word() -> None:
    from worker.config import WorkerConfig

    base = {"server": "tcp://127.0.0.1:5555"}
    assert WorkerConfig(**base, name="gpu-0.node_1").validate().name == "gpu-0.node_1"
    for bad in ("", "a\nb", "w <b>", "-w", "x" * 65):
        with pytest.raises(ConfigError, match="--name"):
            WorkerConfig(**base, name=bad).validate()
