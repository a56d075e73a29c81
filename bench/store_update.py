"""One shard's update alone: wall and CPU time of ``SliceStore.prepare`` (weighted sum of the
staged gradients, optimizer step, checks) and of commit + wire encoding, for a slice of a
model's flat state, on one torch thread.

The CPU time (getrusage) is what the update costs; the wall time also holds waiting for a core
on a shared machine. Medians over ``--rounds`` updates after two warm-up ones.

Usage: python -m bench store-update [--elems 3724654] [--workers 3] [--wire fp32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from bench.harness.record import parse_settings
from common.protocol.chunks import encode
from pserver.store.optimizer import FlatOptimizer
from pserver.store.slices import SliceStore


def cpu_s() -> float:
    """This process's user + system CPU seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elems", type=int, default=11173962 // 3, help="slice size")
    parser.add_argument("--workers", type=int, default=3, help="gradients summed per update")
    parser.add_argument("--wire", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=7)
    args = parse_settings(parser, argv)
    torch.set_num_threads(1)
    n, chunk = args.elems, int(args.chunk_mb * (1 << 20)) // 4
    store = SliceStore(0, n, n, torch.randn(n), FlatOptimizer("sgd", 0.05, 0.9), [], chunk)
    grads = [torch.randn(n) * 1e-3 for _ in range(args.workers)]
    rows = []
    for version in range(1, args.rounds + 3):
        tasks = [100 * version + w for w in range(args.workers)]
        for w, task in enumerate(tasks):
            for a, b in store.spans:
                store.stage(task, w, version - 1, a, 1.0, grads[w][a:b].clone())
        t0, c0 = time.perf_counter(), cpu_s()
        ok, reason = store.prepare(version, tasks, [1 / args.workers] * args.workers, 1.0, 1.0)
        assert ok, reason
        t1, c1 = time.perf_counter(), cpu_s()
        store.commit(version)
        for a, b in store.spans:
            encode(store.state[a:b], args.wire)
        t2, c2 = time.perf_counter(), cpu_s()
        rows.append((t1 - t0, c1 - c0, t2 - t1, c2 - c1))
    rows = rows[2:]
    med = [statistics.median(r[i] for r in rows) * 1000 for i in range(4)]
    print(
        f"slice of {n} values, {args.workers} gradients, wire {args.wire}: prepare {med[0]:.1f} ms "
        f"wall / {med[1]:.1f} ms CPU; commit + encode {med[2]:.1f} ms wall / {med[3]:.1f} ms CPU; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(f"prepare_wall_ms={med[0]:.1f} prepare_cpu_ms={med[1]:.1f}")
    print(f"commit_encode_wall_ms={med[2]:.1f} commit_encode_cpu_ms={med[3]:.1f}")


if __name__ == "__main__":
    main()
