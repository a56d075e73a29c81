"""Async staleness functions side by side, and what --max-staleness costs and buys.

Four workers with slowdowns 1,1,2,4 make pushes arrive several versions late. Variants: the
staleness functions without a bound, then ``inverse`` with ``--max-staleness`` K for each K in
``--bounds`` (rejected pushes are recomputed on fresh parameters).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench import ROOT
from bench.harness.jasper import jasper_prologue
from bench.harness.record import parse_settings
from bench.harness.stats import paired, ratio, spread_text
from common.errors import PSError
from common.logsetup import setup_logging
from common.training.tables import format_table
from launch.compare import run_record
from launch.local import LocalCluster, run_local
from launch.settings import TrainSettings

FUNCTIONS = ("inverse", "poly", "hinge", "exp", "constant")


def variants(functions: list[str], bounds: list[int]) -> list[tuple[str, str, int | None]]:
    """(name, staleness function, bound) for every variant."""
    out: list[tuple[str, str, int | None]] = [(f, f, None) for f in functions]
    out += [(f"inverse_max{k}", "inverse", k) for k in bounds]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every variant, print the table and the ratio lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant (default 1)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (default 6)")
    parser.add_argument("--target-oa", type=float, default=0.9, help="target OA (default 0.9)")
    parser.add_argument("--bounds", default="4,1", help="--max-staleness values (default 4,1)")
    parser.add_argument(
        "--functions",
        default=",".join(FUNCTIONS),
        help=f"staleness functions to run (default {','.join(FUNCTIONS)})",
    )
    parser.add_argument("--slowdowns", default="1,1,2,4", help="worker slowdowns (default 1,1,2,4)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs/bench/staleness", help="output directory"
    )
    args = parse_settings(parser, argv)
    functions = [f.strip() for f in args.functions.split(",") if f.strip()]
    if not set(functions) <= set(FUNCTIONS):
        parser.error(f"--functions {args.functions!r}: choose among {', '.join(FUNCTIONS)}")
    setup_logging("WARNING")
    data = jasper_prologue(args.out)
    if data is None:
        return 2
    train = TrainSettings(epochs=args.epochs).validate()
    slowdowns = tuple(float(s) for s in args.slowdowns.split(","))
    table = variants(functions, [int(k) for k in args.bounds.split(",") if k.strip()])
    runs, failed = [], []
    for repeat in range(1, args.repeats + 1):
        for name, function, bound in table:
            run_dir = args.out / "runs" / f"{name}-{repeat}"
            options = [*train.server_args(), "--staleness", function]
            if bound is not None:
                options += ["--max-staleness", str(bound)]
            cluster = LocalCluster(
                dataset=data,
                model="hsi-cnn",
                mode="async",
                slowdowns=slowdowns,
                run_dir=run_dir,
                server_options=tuple(options),
            )
            print(f"repeat {repeat}: {name}", file=sys.stderr, flush=True)
            try:
                summary = run_local(cluster)
            except PSError as exc:
                failed.append(f"{name} #{repeat}: {exc}")
                continue
            runs.append(run_record(name, repeat, run_dir, summary, args.target_oa))
    rows = []
    for name, _, _ in table:
        mine = [r for r in runs if r["mode"] == name]
        finals = [r["summary"]["final"] for r in mine]
        stale = [r["summary"]["staleness"] or {} for r in mine]
        reached = sum(r["time_to_target_s"] is not None for r in mine)
        rows.append(
            [
                name,
                f"{len(mine)} ({reached} reached)",
                spread_text([r["epoch_time_s"] for r in mine]),
                spread_text([r["time_to_target_s"] for r in mine], 2),
                spread_text([f["oa"] for f in finals], 4),
                spread_text([f["kappa"] for f in finals], 4),
                spread_text([s.get("mean") for s in stale], 2),
                spread_text([s.get("max") for s in stale], 0),
                spread_text([r["summary"]["details"].get("rejected_stale") for r in mine], 0),
            ]
        )
    print(
        f"async on Jasper Ridge 5x5, hsi-cnn, slowdowns {args.slowdowns}, {args.epochs} epochs, "
        f"target OA {args.target_oa}, {args.repeats} repeats (min / median / max)"
    )
    headers = [
        "variant",
        "runs",
        "epoch time s",
        "time to target s",
        "final OA",
        "kappa",
        "staleness mean",
        "max",
        "rejected",
    ]
    print(format_table(headers, rows))
    for line in failed:
        print(f"failed: {line}")
    for name in (name for name, _, _ in table if name != "inverse"):
        quantities = {
            "ttt": ratio("time_to_target_s"),
            "epoch": ratio("epoch_time_s"),
            "oa": lambda r, b: r["summary"]["final"]["oa"] / b["summary"]["final"]["oa"],
        }
        for label, value in quantities.items():
            ratios = paired(runs, name, "inverse", value)
            text = f"{statistics.median(ratios):.2f}" if ratios else "nan"
            print(f"ratio_{label}_{name}_vs_inverse={text}")
    return 1 if failed else 0
