"""Server memory over a long run: resident set size (VmRSS) of ``pserver start`` against the
model version, 2 workers and a small global batch (8), so versions come fast.

The RSS is read (psutil) every 0.5 s with the newest version the run log shows; the
figure is the growth from the first sample at or past ``--from`` versions to the end. With
``--baseline DIR`` the same run is made with the server (and workers) of another checkout
right after, for a side-by-side figure.

Usage: python -m bench server-memory [--versions 5000] [--from 500] [--mode weighted-sync]
                                     [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil

from bench import ROOT
from bench.harness.record import parse_settings
from bench.harness.served import served_run
from common.data.convert.synth import synth_hsi
from launch.procs import new_events

SAMPLE_S = 0.5


def rss_mb(pid: int) -> float:
    """The process's resident set size in MB."""
    return psutil.Process(pid).memory_info().rss / 2**20


def newest_version(metrics: Path, offset: int) -> tuple[int, int]:
    """The newest ``version`` among whole event lines after ``offset``, and the new offset."""
    with metrics.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    version = -1
    for line in chunk[:end].splitlines():
        try:
            value = json.loads(line).get("version")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, int):
            version = max(version, value)
    return version, offset + end


def measure(
    data: Path, run_dir: Path, versions: int, code: Path, mode: str
) -> list[tuple[int, float]]:
    """(version, server RSS MB) samples of one run whose processes import ``code``."""
    options = [
        *("--dataset", str(data), "--model", "hsi-cnn", "--mode", mode),
        *("--global-batch", "8", "--workers", "2", "--max-steps", str(versions)),
        *("--eval-every", "1000", "--eval-samples", "64"),
    ]
    samples: list[tuple[int, float]] = []
    with served_run(code, run_dir, options, 2, start_timeout_s=120, stop_grace_s=60) as run:
        offset = 0
        version = 0
        while run.server.code is None:
            newest, offset = newest_version(run.metrics, offset)
            version = max(version, newest)
            try:
                samples.append((version, rss_mb(run.server.popen.pid)))
            except psutil.Error:
                break
            time.sleep(SAMPLE_S)
    metrics = run_dir / "metrics.jsonl"
    assert new_events(metrics, 0), f"no events in {metrics}"
    return samples


def report(name: str, samples: list[tuple[int, float]], start: int) -> str:
    """One line: RSS at ``start`` versions and at the end, growth in all and per 1000."""
    later = [(v, r) for v, r in samples if v >= start]
    if len(later) < 2:
        return f"{name}: too few samples past version {start} ({len(samples)} in all)"
    (v0, r0), (v1, r1) = later[0], later[-1]
    peak = max(r for _, r in later)
    per_k = (r1 - r0) / max(v1 - v0, 1) * 1000
    return (
        f"{name}: server RSS {r0:.1f} MB at version {v0}, {r1:.1f} MB at version {v1} "
        f"(peak {peak:.1f}): {r1 - r0:+.1f} MB over {v1 - v0} versions, "
        f"{per_k:+.2f} MB per 1000 versions"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5000)
    parser.add_argument("--from", dest="start", type=int, default=500)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--mode", default="weighted-sync", help="the server's --mode")
    args = parse_settings(parser, argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "hsi.h5"
        synth_hsi(data, bands=16, size=48, classes=4, train_fraction=0.5, seed=1)
        runs = [("this checkout", ROOT)]
        if args.baseline is not None:
            runs.append((f"baseline {args.baseline}", args.baseline.resolve()))
        for i, (name, code) in enumerate(runs):
            samples = measure(data, root / f"run{i}", args.versions, code, args.mode)
            print(f"{args.mode}, " + report(name, samples, args.start), flush=True)
            later = [rss for version, rss in samples if version >= args.start]
            if i == 0 and later:
                print(f"rss_start_mb={later[0]:.1f} rss_end_mb={later[-1]:.1f}")


if __name__ == "__main__":
    main()
