"""Epoch time under heterogeneity: weighted-sync against equal-sync and DDP, side by side.

Two workers with slowdowns 1 and 3: equal batches make every round wait for 3·t(B/2) = 1.5·t(B);
speed-proportional batches (3B/4, B/4) finish together after 0.75·t(B), so the ideal ratio is 2.0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench import ROOT
from bench.harness.cluster import (
    add_cluster_arguments,
    cluster_from_args,
    cluster_label,
    worker_count,
)
from bench.harness.record import parse_settings
from bench.harness.stats import paired, ratio, spread_text
from common.data.convert.synth import synth_scenes
from common.logsetup import setup_logging
from common.training.tables import format_table
from launch.compare import CompareConfig, run_compare
from launch.settings import TrainSettings
from launch.slowdowns import parse_slowdowns

MODES = ("weighted-sync", "equal-sync", "ddp")
EPOCH = ratio("epoch_time_s")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    parser.add_argument("--samples", type=int, default=600, help="synthetic images (default 600)")
    parser.add_argument("--global-batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument(
        "--slowdowns",
        default=None,
        help="worker slowdowns (default 1,3 on shared cores, 1 on an emulated cluster)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"modes to run (default {','.join(MODES)})"
    )
    add_cluster_arguments(parser)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs/bench/heterogeneity", help="output directory"
    )
    args = parse_settings(parser, argv)
    modes = tuple(m.strip() for m in args.modes.split(","))
    if "weighted-sync" not in modes or not set(modes) <= set(MODES):
        parser.error(f"--modes {args.modes!r}: weighted-sync and any of {', '.join(MODES)}")
    setup_logging("WARNING")
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / f"scenes64_{args.samples}.h5"
    if not data.exists():
        synth_scenes(data, samples=args.samples, bands=13, size=64, classes=10, seed=0)
    count = worker_count(args, args.slowdowns or "1,3")
    emulated = cluster_from_args(args, count)
    text = args.slowdowns or ("1" if emulated is not None else "1,3")
    slowdowns = parse_slowdowns(text, count)
    config = CompareConfig(
        dataset=data,
        model="scene-cnn",
        modes=modes,
        slowdowns=slowdowns,
        out=args.out,
        train=TrainSettings(epochs=args.epochs, global_batch=args.global_batch),
        repeats=args.repeats,
        nodes=emulated,
        allow_oversubscribe=args.allow_oversubscribe,
    )
    result = run_compare(config, show_progress=sys.stderr.isatty())
    runs = result["runs"]
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode and "error" not in r]
        rounds = [r["summary"]["details"]["round_s_median"] for r in mine]
        shares = ["/".join(str(w["samples"]) for w in r["summary"]["workers"]) for r in mine[:1]]
        rows.append(
            [
                mode,
                len(mine),
                spread_text([r["epoch_time_s"] for r in mine]),
                spread_text(rounds, 4),
                spread_text(paired(runs, "weighted-sync", mode, EPOCH), 2),
                shares[0] if shares else "-",
            ]
        )
    print(
        f"scene-cnn on {data.name} (13x64x64), slowdowns {text}, on {cluster_label(emulated)}, "
        f"B={args.global_batch}, {args.epochs} epochs, {args.repeats} repeats "
        "(min / median / max over repeats)"
    )
    print(
        format_table(
            [
                "mode",
                "runs",
                "epoch time s",
                "median round s",
                "its time / weighted-sync's",
                "samples per worker",
            ],
            rows,
        )
    )
    failed = [f"{r['mode']} #{r['repeat']}" for r in runs if "error" in r]
    if failed:
        print(f"failed runs: {', '.join(failed)}")
    for base in (mode for mode in modes if mode != "weighted-sync"):
        name = base.replace("-", "_")
        ratios = paired(runs, "weighted-sync", base, EPOCH)
        value = statistics.median(ratios) if ratios else float("nan")
        print(f"ratio_weighted_sync_vs_{name}={value:.2f}")
    return 1 if failed else 0
