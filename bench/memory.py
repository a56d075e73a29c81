"""Peak memory of converting and serving a large (~2 GB) dataset, against the file's size.

Each step runs in a fresh interpreter that reports its own peak resident set size
(``getrusage``), so the steps do not inherit each other's peaks:

1. convert: ``synth_scenes`` writes N EuroSAT-shaped images (13 x 64 x 64 float32 by default;
   9800 images are 2.0 GB) in blocks;
2. serve: a ``DatasetReader`` with ``cache_bytes=0`` (``pserver start --cache-mb 0``) reads
   random training batches until it has read as many samples as the file holds;
3. evaluate: ``iter_blocks`` over the test split in blocks of 512 (what evaluation does).

Prints one line per step (peak RSS, peak minus the interpreter's start-up, ratio to the file
size, time) and deletes the file at the end unless ``--keep`` is given.

Usage: python -m bench memory [--samples 9800] [--bands 13] [--size 64] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.harness.record import parse_settings

PEAK = """
import json, sys, time
from common.procs import peak_rss_bytes
def peak_mb():
    return peak_rss_bytes() / 2**20
"""

STEPS = {
    "convert": """
from common.data.convert.synth import synth_scenes
args = json.loads(sys.argv[2])
base = peak_mb()
synth_scenes(sys.argv[1], classes=10, seed=0, **args)
""",
    "serve": """
import numpy as np
from common.data.dataset import DatasetReader
base = peak_mb()
rng = np.random.default_rng(0)
seen = 0
with DatasetReader(sys.argv[1], cache_bytes=0) as reader:
    while seen < reader.meta.num_samples:
        x, y = reader.read(rng.choice(reader.train_indices, 256))
        seen += len(y)
""",
    "evaluate": """
from common.data.dataset import DatasetReader
base = peak_mb()
with DatasetReader(sys.argv[1], cache_bytes=0) as reader:
    for x, y in reader.iter_blocks(reader.test_indices, 512):
        pass
""",
}


def run_step(step: str, path: Path, args: dict[str, int]) -> dict[str, float]:
    """Run one step in a fresh interpreter.

    Args:
        step: a key of ``STEPS``.
        path: the dataset file.
        args: ``synth_scenes`` arguments (convert only).

    Returns:
        ``{"base_mb", "peak_mb", "seconds"}``.

    Raises:
        RuntimeError: the child failed.
    """
    code = PEAK + STEPS[step] + '\nprint(json.dumps({"base_mb": base, "peak_mb": peak_mb()}))\n'
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", code, str(path), json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise RuntimeError(f"step {step} failed:\n{res.stderr[-3000:]}")
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    stats["seconds"] = time.perf_counter() - start
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=9800, help="images (default 9800)")
    parser.add_argument("--bands", type=int, default=13, help="bands per image (default 13)")
    parser.add_argument("--size", type=int, default=64, help="image side (default 64)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the file")
    parser.add_argument("--keep", action="store_true", help="keep the file afterwards")
    opts = parse_settings(parser, argv)
    args = {"samples": opts.samples, "bands": opts.bands, "size": opts.size}
    folder = Path(tempfile.mkdtemp(prefix="bench-memory-", dir=opts.dir))
    path = folder / "scenes.h5"
    try:
        print(
            f"dataset: {opts.samples} images of {opts.bands}x{opts.size}x{opts.size} float32 "
            f"({opts.samples * opts.bands * opts.size**2 * 4 / 2**30:.2f} GiB of samples)"
        )
        rows = [(step, run_step(step, path, args)) for step in STEPS]
        size_mb = path.stat().st_size / 2**20
        print(f"file: {size_mb:.0f} MiB ({path})")
        print(f"{'step':<10}{'peak RSS MiB':>14}{'above start MiB':>17}{'peak/file':>11}{'s':>8}")
        for step, s in rows:
            above = s["peak_mb"] - s["base_mb"]
            ratio = s["peak_mb"] / size_mb
            print(
                f"{step:<10}{s['peak_mb']:>14.0f}{above:>17.0f}{ratio:>11.3f}{s['seconds']:>8.1f}"
            )
        for step, s in rows:
            print(f"{step}_peak_mib={s['peak_mb']:.0f}")
    finally:
        if not opts.keep:
            path.unlink(missing_ok=True)
            folder.rmdir()


if __name__ == "__main__":
    main()
