"""The floor under a loopback round: what ZeroMQ and this machine cost before any of the
parameter server's own work, with the sizes of ``round-overhead`` (hsi-cnn, 87,108 float32
values each way).

Measured in one run, one after the other:

- ``raw``: a plain pyzmq DEALER sends the values, a ROUTER in another process sends as many
  back (no parsing, no asyncio, no checks), request after request;
- ``raw after compute``: the same, but the client spins for ``--compute-ms`` between requests
  as a worker computes its step, while the other process sleeps in its receive as the
  coordinator does;
- ``work``: a fixed piece of a server's kind of work (three element-wise torch ops on the same
  values and a few hundred Python objects) run back to back, and each time right after
  sleeping ``--compute-ms``, in this process.

On a machine whose cores slow down while idle (virtual machines whose idle vCPUs the host
deschedules), the second and third lines show what every round pays once before it starts.
The last lines print ``raw_rtt_ms=``, ``raw_rtt_after_compute_ms=``, ``work_hot_us=``,
``work_after_idle_us=`` and ``idle_slowdown=`` (after idle over hot).

Usage: python -m bench round-floor [--requests 400] [--compute-ms 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import torch
import zmq

from bench.harness.record import parse_settings

VALUES = 87_108  # hsi-cnn's state: parameters and BatchNorm buffers
WARMUP = 30
JOIN_TIMEOUT_S = 30.0
REPLY_TIMEOUT_MS = 10_000


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
        sock.close(linger=0)
        context.term()


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def round_trip_s(requests: int, compute_s: float) -> float:
    """Median seconds of a raw request/reply of ``VALUES`` float32 each way."""
    receive, send = mp.Pipe(duplex=False)
    server = mp.get_context("spawn").Process(target=_echo, args=(requests, send), daemon=True)
    server.start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    times = []
    try:
        if not receive.poll(JOIN_TIMEOUT_S):
            raise RuntimeError("the echo process did not start")
        sock.connect(receive.recv())
        values = np.ones(VALUES, dtype=np.float32).data
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
        server.join(JOIN_TIMEOUT_S)
        if server.is_alive():
            server.kill()
            server.join()
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
    hot = work_s(args.requests, 0.0)
    after_idle = work_s(args.requests, compute_s)
    print(f"{VALUES} float32 values each way, {args.requests} requests, median")
    print(f"raw pyzmq round trip                    {raw * 1e3:7.3f} ms")
    print(f"raw round trip, {args.compute_ms:g} ms compute between   {raw_after * 1e3:7.3f} ms")
    print(f"fixed work, back to back                {hot * 1e6:7.1f} us")
    print(f"fixed work, after {args.compute_ms:g} ms asleep          {after_idle * 1e6:7.1f} us")
    print(f"raw_rtt_ms={raw * 1e3:.3f}")
    print(f"raw_rtt_after_compute_ms={raw_after * 1e3:.3f}")
    print(f"work_hot_us={hot * 1e6:.1f}")
    print(f"work_after_idle_us={after_idle * 1e6:.1f}")
    print(f"idle_slowdown={after_idle / hot:.2f}")


if __name__ == "__main__":
    main()
