"""What snapshots cost training: the same run with snapshots off and every N updates, side by side.

Also the time one snapshot file takes to write (on the server's write thread, not the event
loop) against the median round time, and the time ``pserver evaluate-snapshots`` takes per
snapshot.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import ROOT
from bench.harness.record import parse_settings
from common.data.convert.synth import synth_hsi
from common.logsetup import setup_logging
from common.training.rounds import round_events
from launch.local import LocalCluster, run_local
from pserver.snapshots import snapshots as snap
from pserver.snapshots.snapshot_eval import SnapshotEvalConfig, evaluate_snapshots


def run(data: Path, run_dir: Path, epochs: int, every: int | None) -> dict:
    """One weighted-sync run; returns its summary."""
    shutil.rmtree(run_dir, ignore_errors=True)
    options = ["--epochs", str(epochs), "--global-batch", "32"]
    if every is not None:
        options += ["--snapshot-every-updates", str(every)]
    cluster = LocalCluster(
        dataset=data,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 2.0),
        run_dir=run_dir,
        server_options=tuple(options),
    )
    return run_local(cluster)


def write_seconds(state_size: int, count: int = 20) -> float:
    """Median time to write one snapshot of ``state_size`` values."""
    state = np.random.default_rng(0).standard_normal(state_size).astype(np.float32)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for version in range(1, count + 1):
            begin = time.perf_counter()
            snap.write(Path(tmp), state, snap.SnapshotMeta(version, 1, version, 0.1))
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Run the pairs and print the table and the ratio lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (default 3)")
    parser.add_argument("--every", type=int, default=1, help="snapshot interval (default 1)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (default 4)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs/bench/snapshots", help="output directory"
    )
    args = parse_settings(parser, argv)
    setup_logging("WARNING")
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "hsi.h5"
    if not data.exists():
        synth_hsi(data, bands=32, size=48, classes=6, train_fraction=0.3, seed=3)
    ratios, per_snapshot, rounds = [], [], []
    state_size = 0
    for repeat in range(1, args.repeats + 1):
        times = {}
        for every in (None, args.every):
            name = "off" if every is None else f"every-{every}"
            run_dir = args.out / f"{name}-{repeat}"
            summary = run(data, run_dir, args.epochs, every)
            times[name] = summary["train_time_s"]
            line = f"repeat {repeat} {name:>8}: train_time_s {summary['train_time_s']:.3f}"
            if every is not None:
                files = sorted((run_dir / "snapshots").glob("snap-*.npz"))
                size = sum(f.stat().st_size for f in files)
                begin = time.perf_counter()
                evaluate_snapshots(SnapshotEvalConfig(run_dir, progress=False))
                per_snapshot.append((time.perf_counter() - begin) / len(files))
                line += f", {len(files)} snapshots, {size / 1e6:.1f} MB"
                state_size = snap.read_run_file(run_dir / "snapshots")["state_size"]
            rounds.append(statistics.median(e["round_s"] for e in round_events(run_dir)))
            print(line, f"({summary['steps']} updates)")
        ratios.append(times[f"every-{args.every}"] / times["off"])
    print(f"ratio_train_time_snapshots_vs_off={statistics.median(ratios):.2f}")
    write_s = write_seconds(state_size)
    print(f"write_ms_per_snapshot={1000 * write_s:.2f} ({state_size} values)")
    print(f"ratio_write_vs_median_round={write_s / statistics.median(rounds):.3f}")
    print(f"evaluate_s_per_snapshot={statistics.median(per_snapshot):.4f}")
    return 0
