"""How long the cluster simulator takes: 100 rounds of 1024 workers with 16 shards, per mode.

The cluster: a ResNet-50-sized model (25.6 M parameters, fp32 on the wire), 10 Gbit/s links,
three node groups in a 1:1:2 ratio at 0.75, 1.7 and 4.8 ms per sample (5 ms per step; the T4-like
group's speeds drawn lognormal with sigma 0.05), a global batch of 32 per worker, shards
co-located on worker hosts. Weighted-sync is timed with nodes whose step times scatter by 5 %
from round to round (the planner drops stragglers, a re-plan per dropped worker) and steady.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from bench.harness.record import parse_settings
from launch.simulate.engine import SIM_MODES, simulate
from launch.simulate.spec import cluster_from_spec

SPEC = {
    "model_params": 25_600_000,
    "global_batch": 32,
    "samples": 1_281_167,
    "shards": 1,
    "link": {"gbit": 10, "latency_ms": 0.05},
    "server": {"step_ms": 1.0, "step_ms_per_mb": 0.3, "decode_ms_per_mb": 0.2},
    "groups": [
        {"name": "A100", "count": 1, "per_sample_ms": 0.75, "fixed_ms": 5},
        {"name": "V100", "count": 1, "per_sample_ms": 1.7, "fixed_ms": 5},
        {"name": "T4", "count": 2, "per_sample_ms": 4.8, "fixed_ms": 5, "lognormal_sigma": 0.05},
    ],
}


def main(argv: list[str] | None = None) -> int:
    """Time each mode; print the seconds per case."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=100)
    args = parse_settings(parser, argv)
    base = cluster_from_spec(SPEC).with_workers(args.workers)
    steady = dataclasses.replace(base, shards=args.shards, global_batch=32 * args.workers)
    jittery = dataclasses.replace(
        steady, nodes=tuple(dataclasses.replace(n, jitter=0.05) for n in steady.nodes)
    )
    epochs = math.ceil(args.rounds * steady.global_batch / steady.samples)
    cases = [(f"{m}_jitter", jittery, m) for m in SIM_MODES]
    cases.append(("weighted-sync_steady", steady, "weighted-sync"))
    for name, cluster, mode in cases:
        began = time.perf_counter()
        result = simulate(cluster, mode, epochs=epochs, max_rounds=args.rounds)
        took = time.perf_counter() - began
        print(
            f"{name:22s} {args.workers} workers, {args.shards} shards, {result.rounds} "
            f"{'pushes' if mode == 'async' else 'rounds'}: {took:.2f} s "
            f"(round {result.round_s:.3f} s, members {result.members})"
        )
        print(f"simulate_{name}_s={took:.2f}")
    return 0
