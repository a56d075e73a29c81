"""Fused push+pull round trip of the parameter server against a raw ZeroMQ round trip.

Both carry 11,689,512 float32 values (a ResNet-18) each way over TCP on 127.0.0.1 and are
measured alternately in one run. The PS round trip is what a worker does with ``--shards 1``:
the gradient in chunks to the server's store, the push request, the update (checks, optimizer
step, copy-on-step) and the new parameters back in chunks.
The last line is ``ratio=X.XX`` (median PS time / median raw time).

Usage: python -m bench wire [--rounds 20] [--momentum 0.9] [--wire-dtype fp32] [--chunk-mb 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from bench import ROOT
from bench.harness.record import parse_settings
from bench.wire_model import RESNET18_PARAMS
from common.data.convert.synth import synth_hsi
from common.procs import Child
from common.protocol.client import Connection
from common.protocol.messages import (
    JoinReply,
    JoinRequest,
    PushRequest,
    TaskReply,
    TaskRequest,
)
from worker.params import StoreClient

STARTUP_TIMEOUT_S = 120.0


def echo_server(endpoint_queue: mp.Queue) -> None:
    """A raw ROUTER that sends every message straight back (zero-copy)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_queue.put(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"quit":
            break
        sock.send_multipart(frames, copy=False)
    sock.close()
    ctx.term()


def start_pserver(dataset: Path, momentum: float, wire: str, chunk_mb: float) -> tuple[Child, str]:
    """A real ``pserver start`` process in async mode with the ResNet-18-sized model, and its
    address. It writes no run files (they would add their own cost to each push), so its
    address comes from its ``listening on`` log line rather than a ``start`` event."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = Child(
        "server",
        [
            sys.executable,
            "-m",
            "pserver.cli",
            "start",
            "--bind",
            "tcp://127.0.0.1:0",
            "--dataset",
            str(dataset),
            "--model",
            "bench.wire_model:factory",
            "--mode",
            "async",
            "--max-steps",
            "1000000",
            "--momentum",
            str(momentum),
            "--weight-decay",
            "0",
            "--log-level",
            "WARNING",
            "--shutdown-timeout",
            "1",
            "--global-batch",  # one sample per push: no epoch ends, so no evaluation runs
            "1",
            "--wire-dtype",
            wire,
            "--chunk-mb",
            str(chunk_mb),
        ],
        env=env,
        cwd=ROOT,
        stderr_only=True,
    )
    try:
        line = proc.wait_for("pserver listening on ", STARTUP_TIMEOUT_S)
    except BaseException:
        proc.kill()
        raise
    return proc, line.split("listening on", 1)[1].strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wire-dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    args = parse_settings(parser, argv)

    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "tiny.h5"
        synth_hsi(dataset, bands=8, size=24, classes=3, train_fraction=0.5, seed=0)
        queue: mp.Queue = mp.Queue()
        echo = mp.Process(target=echo_server, args=(queue,), daemon=True)
        echo.start()
        raw_endpoint = queue.get(timeout=30)
        server, ps_endpoint = start_pserver(dataset, args.momentum, args.wire_dtype, args.chunk_mb)
        try:
            run(raw_endpoint, ps_endpoint, args)
        finally:
            server.stop(grace=60)
            ctx = zmq.Context()
            quit_sock = ctx.socket(zmq.DEALER)
            quit_sock.connect(raw_endpoint)
            quit_sock.send(b"quit")
            echo.join(timeout=10)
            quit_sock.close(linger=0)
            ctx.term()


def run(raw_endpoint: str, ps_endpoint: str, args: argparse.Namespace) -> None:
    """Alternate PS and raw round trips and print the medians and their ratio.

    The PS side is the worker's own code: ``StoreClient`` sends the gradient chunks, the push
    request goes to the coordinator, and the new parameters come back chunk by chunk.
    """
    ctx = zmq.Context()
    ps = Connection(ps_endpoint, timeout_s=120, context=ctx)
    join = ps.request(
        JoinRequest(name="bench", device="cpu", slowdown=1.0, threads=1), expect=JoinReply
    )
    size = join.state_size
    assert size >= RESNET18_PARAMS, size
    assert args.warmup + args.rounds < 200, "stay within one epoch: evaluation would interfere"
    stores = StoreClient(
        ctx,
        join.shard_addresses,
        join.shard_bounds,
        ps_endpoint,
        join.chunk_elems,
        join.wire_dtype,
        join.worker_id,
        join.store_token,
    )
    task = ps.request(
        TaskRequest(worker_id=join.worker_id, token=join.token, speed=1000.0), expect=TaskReply
    )
    state = torch.empty(size)
    stores.pull(task.version)
    stores.collect(state, 120)
    grad = torch.from_numpy(np.random.default_rng(0).normal(0, 1e-3, size).astype(np.float32))

    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(raw_endpoint)
    payload = grad.numpy().copy()

    def ps_round() -> float:
        nonlocal task
        begin = time.perf_counter()
        stores.push(task.task_id, task.push_token, task.version, grad)
        reply = ps.request(
            PushRequest(
                worker_id=join.worker_id,
                token=join.token,
                task_id=task.task_id,
                version=task.version,
                batch_size=len(task.indices),
                speed=1000.0,
                compute_s=0.0,
                transfer_s=0.0,
                loss=1.0,
            ),
            expect=TaskReply,
        )
        version = stores.collect(state, 120)
        elapsed = time.perf_counter() - begin
        assert reply.action == "train" and version == reply.version
        task = reply
        return elapsed

    def raw_round() -> float:
        begin = time.perf_counter()
        raw.send_multipart([b"header", payload.data], copy=False)
        frames = raw.recv_multipart(copy=False)
        elapsed = time.perf_counter() - begin
        assert len(frames[1]) == payload.nbytes
        return elapsed

    ps_times, raw_times = [], []
    for i in range(args.warmup + args.rounds):
        p, r = ps_round(), raw_round()
        if i >= args.warmup:
            ps_times.append(p)
            raw_times.append(r)
    raw.close(linger=0)
    stores.close()
    ps.close()
    ctx.term()
    mb = size * 4 / 1e6
    ps_med, raw_med = statistics.median(ps_times), statistics.median(raw_times)
    print(
        f"payload: {size:,} float32 = {mb:.1f} MB each way; {args.rounds} rounds; "
        f"server SGD momentum {args.momentum}; wire {join.wire_dtype}, chunks of "
        f"{join.chunk_elems:,} values"
    )
    print(
        f"raw DEALER/ROUTER round trip (fp32, one message): median {raw_med * 1e3:.1f} ms "
        f"(min {min(raw_times) * 1e3:.1f}, max {max(raw_times) * 1e3:.1f})"
    )
    print(
        f"PS fused push+pull round trip: median {ps_med * 1e3:.1f} ms "
        f"(min {min(ps_times) * 1e3:.1f}, max {max(ps_times) * 1e3:.1f})"
    )
    print(f"ratio={ps_med / raw_med:.2f}")


if __name__ == "__main__":
    main()
