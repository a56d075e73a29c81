"""Checkpoint write and restore time for a ResNet-18's worth of state (11,689,512 values).

Measures the server's own path: capture (copy of the optimizer state between updates),
atomic write of the .npz (temporary file, fsync, rename), then read and restore into a fresh
trainer. SGD with momentum, so the file holds the parameters and the momentum buffer.

Usage: python bench/checkpoint.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pserver.trainer import Trainer

from bench.wire_model import RESNET18_PARAMS
from pserver import checkpoint
from pserver.config import ServerConfig


async def one_round(directory: Path) -> tuple[float, float, int]:
    """Write then restore one checkpoint; returns (write s, restore s, file bytes)."""
    config = ServerConfig(dataset=Path("unused.h5"), model="bench", epochs=1)
    trainer = Trainer(config, torch.randn(RESNET18_PARAMS), RESNET18_PARAMS, 1000)
    await trainer.apply(torch.randn(RESNET18_PARAMS), samples=64, buffer_scale=1.0)

    begin = time.perf_counter()
    arrays, counters = await trainer.capture()
    path = checkpoint.write(directory, checkpoint.Checkpoint(arrays, dict(counters)))
    written = time.perf_counter() - begin

    begin = time.perf_counter()
    loaded = checkpoint.read(path)
    fresh = Trainer(config, torch.zeros(RESNET18_PARAMS), RESNET18_PARAMS, 1000)
    fresh.restore(loaded.arrays, loaded.meta)
    restored = time.perf_counter() - begin
    assert torch.equal(fresh.snapshot.state, trainer.snapshot.state)
    assert torch.equal(fresh.optimizer.state["momentum"], trainer.optimizer.state["momentum"])
    size = path.stat().st_size
    trainer.close()
    fresh.close()
    return written, restored, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    writes, restores = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            w, r, size = asyncio.run(one_round(Path(tmp) / str(i)))
            writes.append(w)
            restores.append(r)
    print(
        f"state {RESNET18_PARAMS:,} float32 + momentum; file {size / 1e6:.1f} MB; "
        f"{args.repeats} repeats"
    )
    for name, times in (("write", writes), ("restore", restores)):
        print(
            f"{name}: min {min(times):.3f} s, median {statistics.median(times):.3f} s, "
            f"max {max(times):.3f} s"
        )


if __name__ == "__main__":
    main()
