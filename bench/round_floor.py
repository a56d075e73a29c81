"""The floor under a loopback round: what ZeroMQ and this machine cost before any of the
parameter server's own work, with the sizes of ``round-overhead`` (hsi-cnn, 87,108 float32
values each way).

On a machine whose cores slow down while idle (virtual machines whose idle vCPUs the host
deschedules), the round trips after compute show what every round pays once before it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
import zmq
import zmq.asyncio
from torch import nn

from bench import ROOT
from bench.harness.record import parse_settings
from bench.harness.served import served_run
from common.data.convert.synth import synth_hsi
from common.eventloop import run
from common.protocol.client import Connection as PSConnection
from common.protocol.messages import JoinReply, JoinRequest, PushRequest, TaskReply, TaskRequest
from worker.params import StoreClient

VALUES = 87_108  # hsi-cnn's state: parameters and BatchNorm buffers
WARMUP = 30
JOIN_TIMEOUT_S = 30.0
REPLY_TIMEOUT_MS = 10_000
# The echo processes close with this linger: a close with linger 0 right after the last send
# may discard that reply before ZeroMQ's I/O thread has written it, and the client then waits
# for it in vain.
FLUSH_LINGER_MS = 10_000
LR, MOMENTUM = 0.01, 0.9
WIRE_VALUES = 11_689_512  # a ResNet-18's parameters, for --wire


@dataclasses.dataclass(frozen=True)
class Echo:
    """What an echo process answers: ``requests`` messages of ``values`` float32 values each
    way; the asyncio step server takes ``gather`` gradients per step (a synchronous round of
    that many workers: summed, one step, each answered) or one at a time."""

    requests: int
    gather: int = 1
    values: int = VALUES


def _echo(spec: Echo, address_out: Connection) -> None:
    """The ROUTER side: answer ``spec.requests`` requests with as many values, then exit."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    address_out.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    values = np.ones(spec.values, dtype=np.float32).data
    try:
        for _ in range(spec.requests):
            if not sock.poll(REPLY_TIMEOUT_MS):
                return
            identity, *_ = sock.recv_multipart(copy=False)
            sock.send_multipart([identity.bytes, b"h", values], copy=False)
    finally:
        sock.close(linger=FLUSH_LINGER_MS)
        context.term()


class _MomentumStep:
    """One momentum-SGD step on ``VALUES`` float32 parameters, as the coordinator's least work."""

    def __init__(self) -> None:
        self.params, self.momentum = torch.zeros(VALUES), torch.zeros(VALUES)

    def __call__(self, gradient: torch.Tensor) -> memoryview:
        self.momentum.mul_(MOMENTUM).add_(gradient)
        self.params.add_(self.momentum, alpha=-LR)
        return self.params.numpy().data


def _asyncio_step_echo(spec: Echo, address_out: Connection) -> None:
    """The same ROUTER on the event loop ``common.eventloop`` picks: per ``spec.gather``
    received gradients one step (their sum), each answered with the parameters."""

    async def serve() -> None:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        address_out.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        step = _MomentumStep()
        try:
            for _ in range(spec.requests // spec.gather):
                got = []
                for _ in range(spec.gather):
                    frames = sock.recv_multipart(copy=False)
                    try:
                        got.append(await asyncio.wait_for(frames, REPLY_TIMEOUT_MS / 1e3))
                    except TimeoutError:
                        return
                grads = [torch.frombuffer(g.buffer, dtype=torch.float32) for _, _, g in got]
                params = step(grads[0] if len(grads) == 1 else torch.stack(grads).sum(0))
                for identity, _, _ in got:
                    await sock.send_multipart([identity.bytes, b"h", params], copy=False)
        finally:
            sock.close(linger=FLUSH_LINGER_MS)
            context.term()

    torch.set_num_threads(1)
    run(serve())


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def echo_client(
    server: Callable[[Echo, Connection], None], spec: Echo, clients: int = 1
) -> Iterator[Callable[[float], float]]:
    """``server`` in another process and ``clients`` DEALER sockets to it; yields
    ``round_trip(compute_s)``: spin ``compute_s``, send ``spec.values`` float32 values on every
    socket, return the seconds until every reply is in."""
    receive, send = mp.Pipe(duplex=False)
    process = mp.get_context("spawn").Process(target=server, args=(spec, send), daemon=True)
    process.start()
    context = zmq.Context()
    socks = [context.socket(zmq.DEALER) for _ in range(clients)]
    values = np.full(spec.values, 1e-3, dtype=np.float32).data

    def round_trip(compute_s: float) -> float:
        _spin(compute_s)
        begin = time.perf_counter()
        for sock in socks:
            sock.send_multipart([b"h", values], copy=False)
        for sock in socks:
            if not sock.poll(REPLY_TIMEOUT_MS):
                raise RuntimeError("no reply from the echo process")
            sock.recv_multipart(copy=False)
        return time.perf_counter() - begin

    try:
        if not receive.poll(JOIN_TIMEOUT_S):
            raise RuntimeError("the echo process did not start")
        address = receive.recv()
        for sock in socks:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        yield round_trip
    finally:
        for sock in socks:
            sock.close(linger=0)
        context.term()
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def round_trip_s(
    requests: int,
    compute_s: float,
    server: Callable[[Echo, Connection], None] = _echo,
    clients: int = 1,
    gather: int = 1,
) -> float:
    """Median seconds of a request/reply of ``VALUES`` float32 each way from ``clients``
    sockets at once (until the last reply), ``server`` answering."""
    with echo_client(server, Echo(requests * clients, gather), clients) as round_trip:
        times = [round_trip(compute_s) for _ in range(requests)]
    return statistics.median(times[WARMUP:])


def step_s(repeats: int) -> float:
    """Median seconds of the momentum step, hot, in this process."""
    torch.set_num_threads(1)
    step, gradient = _MomentumStep(), torch.full((VALUES,), 1e-3)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        step(gradient)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[WARMUP:])


def work_s(repeats: int, idle_s: float) -> float:
    """Median seconds of the fixed piece of work, each run after sleeping ``idle_s``."""
    torch.set_num_threads(1)
    a, b, out = torch.randn(VALUES), torch.randn(VALUES), torch.empty(VALUES)
    times = []
    for _ in range(repeats):
        if idle_s:
            time.sleep(idle_s)
        begin = time.perf_counter()
        torch.add(a, b, alpha=0.9, out=out)
        torch.add(out, a, alpha=-0.01, out=out)
        float(out.sum())
        names = {i: str(i) for i in range(300)}
        sum(len(v) for v in names.values())
        times.append(time.perf_counter() - begin)
    return statistics.median(times[WARMUP:])


def wire_model(in_channels: int, num_classes: int, input_size: int) -> nn.Module:
    """A model factory (``--model bench.round_floor:wire_model``) with ``WIRE_VALUES``
    parameters: a linear head on pooled input, and an unused block that makes up the size."""
    model = nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)
    )
    used = sum(p.numel() for p in model.parameters())
    model.register_parameter("block", nn.Parameter(torch.zeros(WIRE_VALUES - used)))
    return model


def wire_ratio(requests: int) -> tuple[float, float]:
    """Median seconds of the parameter server's fused push and pull of ``WIRE_VALUES`` float32
    each way (a real ``pserver start``, async, ``--shards 1``; the worker's own ``StoreClient``
    sends the gradient's chunks and the push request and loads the parameters' chunks) and of a
    raw ZeroMQ round trip of as many values, alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "tiny.h5"
        synth_hsi(dataset, bands=8, size=24, classes=3, train_fraction=0.5, seed=0)
        options = [
            *("--dataset", str(dataset), "--model", "bench.round_floor:wire_model"),
            *("--mode", "async", "--global-batch", "1", "--max-steps", "1000000"),
            *("--eval-every", "1000000", "--weight-decay", "0", "--log-level", "WARNING"),
            *("--dead-after", "600"),  # this client sends no heartbeats
        ]
        served = served_run(ROOT, Path(tmp) / "run", options, 0, start_timeout_s=120.0,
                            stop_grace_s=30.0)  # fmt: skip
        with served as job, echo_client(_echo, Echo(requests, values=WIRE_VALUES)) as raw:
            context = zmq.Context()
            conn = PSConnection(job.address, REPLY_TIMEOUT_MS / 1e3, context=context)
            join = conn.request(JoinRequest("bench", "cpu", 1.0, 1), expect=JoinReply)
            stores = StoreClient(context, join, coordinator=job.address)
            ask = TaskRequest(worker_id=join.worker_id, token=join.token, speed=1e3)
            task = conn.request(ask, expect=TaskReply)
            state = torch.empty(join.state_size)
            grad = torch.full((join.state_size,), 1e-3)
            stores.pull(task.version)
            stores.collect(state, REPLY_TIMEOUT_MS / 1e3)
            times: list[tuple[float, float]] = []
            try:
                for _ in range(requests):
                    begin = time.perf_counter()
                    stores.push(task.task_id, task.push_token, task.version, grad)
                    push = PushRequest(join.worker_id, join.token, task.task_id, task.version,
                                       len(task.indices), 1e3, 0.0, 0.0, 1.0)  # fmt: skip
                    task = conn.request(push, expect=TaskReply)
                    stores.collect(state, REPLY_TIMEOUT_MS / 1e3)
                    times.append((time.perf_counter() - begin, raw(0.0)))
            finally:
                stores.close()
                conn.close()
                context.term()
    return statistics.median(t for t, _ in times[WARMUP:]), statistics.median(
        r for _, r in times[WARMUP:]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--compute-ms", type=float, default=8.0)
    parser.add_argument(
        "--wire", action="store_true", help="the 11.7 M-value fused push and pull instead"
    )
    args = parse_settings(parser, argv)
    if args.requests <= WARMUP:
        parser.error(f"--requests must exceed {WARMUP}")
    if args.wire:
        ps, raw = wire_ratio(args.requests)
        print(f"{WIRE_VALUES:,} float32 values each way ({WIRE_VALUES * 4 / 1e6:.1f} MB), median")
        print(f"raw ZeroMQ round trip                   {raw * 1e3:7.1f} ms")
        print(f"parameter server: fused push and pull   {ps * 1e3:7.1f} ms")
        print(f"ratio={ps / raw:.2f}")
        return
    compute_s = args.compute_ms / 1e3
    raw = round_trip_s(args.requests, 0.0)
    raw_after = round_trip_s(args.requests, compute_s)
    asyncio_after = round_trip_s(args.requests, compute_s, _asyncio_step_echo)
    step = step_s(args.requests)
    hot = work_s(args.requests, 0.0)
    after_idle = work_s(args.requests, compute_s)
    print(f"{VALUES} float32 values each way, {args.requests} requests, median")
    print(f"raw pyzmq round trip                    {raw * 1e3:7.3f} ms")
    print(f"raw round trip, {args.compute_ms:g} ms compute between   {raw_after * 1e3:7.3f} ms")
    print(f"asyncio + momentum step, {args.compute_ms:g} ms compute  {asyncio_after * 1e3:7.3f} ms")
    print(f"momentum step alone, hot                {step * 1e6:7.1f} us")
    print(f"fixed work, back to back                {hot * 1e6:7.1f} us")
    print(f"fixed work, after {args.compute_ms:g} ms asleep          {after_idle * 1e6:7.1f} us")
    print(f"raw_rtt_ms={raw * 1e3:.3f}")
    print(f"raw_rtt_after_compute_ms={raw_after * 1e3:.3f}")
    print(f"asyncio_step_rtt_after_compute_ms={asyncio_after * 1e3:.3f}")
    print(f"step_us={step * 1e6:.1f}")
    print(f"floor_overhead_ms={(asyncio_after - step) * 1e3:.3f}")
    print(f"work_hot_us={hot * 1e6:.1f}")
    print(f"work_after_idle_us={after_idle * 1e6:.1f}")
    print(f"idle_slowdown={after_idle / hot:.2f}")
