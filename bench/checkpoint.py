"""Checkpoint write and restore time for a ResNet-18's worth of state (11,689,512 values).

Measures the server's own path: capture (a copy of the state and optimizer slots), atomic
write of the .npz (temporary file, fsync, rename), then read and restore into a fresh store.
SGD with momentum, so the file holds the parameters and the momentum buffer.

Usage: python -m bench checkpoint [--repeats 5] [--values N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness.record import parse_settings
from bench.wire_model import RESNET18_PARAMS
from pserver import checkpoint
from pserver.store.optimizer import FlatOptimizer
from pserver.store.service import StoreService  # noqa: F401  (the path the server uses)
from pserver.store.slices import SliceStore


def _store(state: torch.Tensor) -> SliceStore:
    optimizer = FlatOptimizer("sgd", lr=0.05, momentum=0.9)
    size = state.numel()
    return SliceStore(0, size, size, state, optimizer, [], 1 << 20)


async def one_round(directory: Path, values: int) -> tuple[float, float, int]:
    """Write then restore one checkpoint of ``values`` parameters; returns (write s, restore s,
    file bytes)."""
    store = _store(torch.randn(values))
    for offset in range(0, values, 1 << 20):
        store.stage(1, 1, 0, offset, 1.0, torch.randn(min(1 << 20, values - offset)))
    assert store.prepare(1, [1], [1.0], 1.0, 1.0)[0]
    store.commit(1)  # one step: the momentum buffer is not zero

    begin = time.perf_counter()
    names, rows = store.slot_state()
    arrays = {"state": store.state.numpy().copy(), "slots": rows.numpy()}
    meta = {"version": store.version, "slots": names, "optimizer_steps": 1}
    path = checkpoint.write(directory, checkpoint.Checkpoint(arrays, meta))
    written = time.perf_counter() - begin

    begin = time.perf_counter()
    loaded = checkpoint.read(path)
    fresh = _store(torch.from_numpy(loaded.arrays["state"]))
    fresh.load_slots(loaded.meta["slots"], torch.from_numpy(loaded.arrays["slots"]), 1)
    restored = time.perf_counter() - begin
    assert torch.equal(fresh.state, store.state)
    assert torch.equal(fresh.optimizer.state["momentum"], store.optimizer.state["momentum"])
    return written, restored, path.stat().st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--values", type=int, default=RESNET18_PARAMS, help="parameters (default a ResNet-18's)"
    )
    args = parse_settings(parser, argv)
    writes, restores = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            w, r, size = asyncio.run(one_round(Path(tmp) / str(i), args.values))
            writes.append(w)
            restores.append(r)
    print(
        f"state {args.values:,} float32 + momentum; file {size / 1e6:.1f} MB; "
        f"{args.repeats} repeats"
    )
    for name, times in (("write", writes), ("restore", restores)):
        print(
            f"{name}: min {min(times):.3f} s, median {statistics.median(times):.3f} s, "
            f"max {max(times):.3f} s"
        )
    print(f"write_s={statistics.median(writes):.3f}")
    print(f"restore_s={statistics.median(restores):.3f}")


if __name__ == "__main__":
    main()
