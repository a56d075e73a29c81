"""The floor under a loopback round: what ZeroMQ and this machine cost before any of the
parameter server's own work, with the sizes of ``round-overhead`` (hsi-cnn, 87,108 float32
values each way).

Measured in one run, one after the other:

- ``raw``: a plain pyzmq DEALER sends the values, a ROUTER in another process sends as many
  back (no parsing, no asyncio, no checks), request after request;
- ``raw after compute``: the same, but the client spins for ``--compute-ms`` between requests
  as a worker computes its step, while the other process sleeps in its receive as the
  coordinator does;
- ``asyncio step after compute``: the least a parameter server on asyncio and pyzmq can do in
  a round, with the same compute between requests: the other process receives the values on
  an asyncio loop (``zmq.asyncio``), applies one momentum-SGD step with them to its own copy
  and sends that copy back; ``step`` is the same arithmetic run hot in this process, which the
  in-process step of ``round-overhead`` pays too, so their difference is the round overhead
  of such a minimal server (``floor_overhead_ms``);
- ``work``: a fixed piece of a server's kind of work (three element-wise torch ops on the same
  values and a few hundred Python objects) run back to back, and each time right after
  sleeping ``--compute-ms``, in this process.

On a machine whose cores slow down while idle (virtual machines whose idle vCPUs the host
deschedules), the second and third lines show what every round pays once before it starts.
The last lines print ``raw_rtt_ms=``, ``raw_rtt_after_compute_ms=``,
``asyncio_step_rtt_after_compute_ms=``, ``step_us=``, ``floor_overhead_ms=``, ``work_hot_us=``,
``work_after_idle_us=`` and ``idle_slowdown=`` (after idle over hot).

Usage: python -m bench round-floor [--requests 400] [--compute-ms 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch
import zmq
import zmq.asyncio

from bench.harness.record import parse_settings

VALUES = 87_108  # hsi-cnn's state: parameters and BatchNorm buffers
WARMUP = 30
JOIN_TIMEOUT_S = 30.0
REPLY_TIMEOUT_MS = 10_000
# The echo processes close with this linger: a close with linger 0 right after the last send
# may discard that reply before ZeroMQ's I/O thread has written it, and the client then waits
# for it in vain.
FLUSH_LINGER_MS = 10_000
LR, MOMENTUM = 0.01, 0.9


def _echo(requests: int, address_out: Connection) -> None:
    """The ROUTER side: answer ``requests`` requests with as many values, then exit."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    address_out.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    values = np.ones(VALUES, dtype=np.float32).data
    try:
        for _ in range(requests):
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


def _asyncio_step_echo(requests: int, address_out: Connection) -> None:
    """The same ROUTER on an asyncio loop: apply each received gradient, answer with the
    parameters, ``requests`` times, then exit."""

    async def serve() -> None:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        address_out.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        step = _MomentumStep()
        try:
            for _ in range(requests):
                frames = sock.recv_multipart(copy=False)
                try:
                    identity, _, gradient = await asyncio.wait_for(frames, REPLY_TIMEOUT_MS / 1e3)
                except TimeoutError:
                    return
                params = step(torch.frombuffer(gradient.buffer, dtype=torch.float32))
                await sock.send_multipart([identity.bytes, b"h", params], copy=False)
        finally:
            sock.close(linger=FLUSH_LINGER_MS)
            context.term()

    torch.set_num_threads(1)
    asyncio.run(serve())


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def round_trip_s(
    requests: int, compute_s: float, server: Callable[[int, Connection], None] = _echo
) -> float:
    """Median seconds of a request/reply of ``VALUES`` float32 each way, ``server`` answering."""
    receive, send = mp.Pipe(duplex=False)
    process = mp.get_context("spawn").Process(target=server, args=(requests, send), daemon=True)
    process.start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    times = []
    try:
        if not receive.poll(JOIN_TIMEOUT_S):
            raise RuntimeError("the echo process did not start")
        sock.connect(receive.recv())
        values = np.full(VALUES, 1e-3, dtype=np.float32).data
        for _ in range(requests):
            _spin(compute_s)
            begin = time.perf_counter()
            sock.send_multipart([b"h", values], copy=False)
            if not sock.poll(REPLY_TIMEOUT_MS):
                raise RuntimeError("no reply from the echo process")
            sock.recv_multipart(copy=False)
            times.append(time.perf_counter() - begin)
    finally:
        sock.close(linger=0)
        context.term()
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--compute-ms", type=float, default=8.0)
    args = parse_settings(parser, argv)
    if args.requests <= WARMUP:
        parser.error(f"--requests must exceed {WARMUP}")
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


if __name__ == "__main__":
    main()
