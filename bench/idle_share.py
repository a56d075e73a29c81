"""Idle time at the round barrier: weighted-sync with the model planner, equal-sync,
weighted-sync with the speed planner and with the model planner on predictions alone
(``--no-plan-spread``), side by side on Jasper Ridge.

The server evaluates only at the end (``--eval-every 0``): on a cluster it evaluates on its own
host, while here an in-run evaluation takes one of the cores the workers share; the last
configuration shows weighted-sync with per-epoch evaluations beside the others.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.harness.cluster import add_cluster_arguments, cluster_from_args, cluster_label
from bench.harness.record import parse_settings
from common.logsetup import setup_logging
from common.training.rounds import round_events
from common.training.tables import format_table
from launch.demo import prepare_dataset
from launch.local import LocalCluster, run_local

SLOWDOWNS = (1.0, 2.0, 4.0)
CONFIGS = (  # name, mode, further server options
    ("weighted-sync/model", "weighted-sync", ()),
    ("equal-sync", "equal-sync", ()),
    ("weighted-sync/speed", "weighted-sync", ("--planner", "speed")),
    ("weighted-sync/model-no-spread", "weighted-sync", ("--no-plan-spread",)),
    ("weighted-sync/model+evals", "weighted-sync", ("--eval-every", "1")),
)
COLUMNS = ["config", "repeat", "idle share", "systematic idle", "OA", "train s", "rounds",
           "sample shares"]  # fmt: skip


def systematic_idle(run_dir: Path) -> float | None:
    """The idle share a steady imbalance would cause, without round-to-round noise.

    Per worker, the median over rounds of (its actual time - the round's mean actual time)
    is its bias; each round then counts sum over its workers of (the largest bias among them
    - bias_i), over (its workers * the median round time). A plan that balances the workers
    has a small one even on a noisy machine; equal-sync's is large.
    """
    rounds = [e for e in round_events(run_dir) if len(e["workers"]) > 1]
    deviations: dict[str, list[float]] = {}
    for event in rounds:
        mean = statistics.fmean(w["actual_s"] for w in event["workers"])
        for w in event["workers"]:
            deviations.setdefault(w["worker"], []).append(w["actual_s"] - mean)
    if not deviations:
        return None
    bias = {name: statistics.median(d) for name, d in deviations.items()}
    typical = statistics.median(e["round_s"] for e in rounds)
    steady = slots = 0.0
    for event in rounds:
        mine = [bias[w["worker"]] for w in event["workers"]]
        steady += sum(max(mine) - b for b in mine)
        slots += len(mine) * typical
    return steady / slots


def shares(summary: dict[str, Any]) -> str:
    """Share of samples per worker, by slowdown (or by CPU budget, largest first)."""
    total = sum(w["samples"] for w in summary["workers"]) or 1
    if all(w.get("cpus") for w in summary["workers"]):
        by = sorted(summary["workers"], key=lambda w: -w["cpus"])
        return " ".join(f"{w['cpus']:g}c:{w['samples'] / total:.3f}" for w in by)
    by = sorted(summary["workers"], key=lambda w: w["slowdown"])
    return " ".join(f"x{w['slowdown']:g}:{w['samples'] / total:.3f}" for w in by)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run")
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench/idle_share")
    parser.add_argument(
        "--configs",
        default=",".join(name for name, *_ in CONFIGS),
        help="configurations to run; the first is the one the others are compared with",
    )
    add_cluster_arguments(parser)
    args = parse_settings(parser, argv)
    chosen = args.configs.split(",")
    configs = [config for config in CONFIGS if config[0] in chosen]
    if len(configs) != len(chosen) or not configs or configs[0] != CONFIGS[0]:
        names = ", ".join(name for name, *_ in CONFIGS)
        parser.error(f"--configs {args.configs!r}: {CONFIGS[0][0]} first, then any of {names}")
    setup_logging("WARNING")
    emulated = cluster_from_args(args, len(SLOWDOWNS))
    print(f"on {cluster_label(emulated)}")
    # shared cores: slowdowns 1, 2, 4; an emulated cluster: its budgets, slowdown 1
    slowdowns = SLOWDOWNS if emulated is None else (1.0,) * len(SLOWDOWNS)
    server_options = (
        *("--epochs", str(args.epochs), "--lr", "0.05", "--lr-schedule", "cosine"),
        *("--eval-every", "0", "--overwrite"),
    )
    dataset = prepare_dataset(args.shared, args.out)
    rows = []
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in configs}
    for repeat in range(args.repeats):
        for name, mode, options in configs:
            run_dir = args.out / f"{name.replace('/', '-').replace('+', '-')}-{repeat}"
            cluster = LocalCluster(
                dataset=dataset,
                model="hsi-cnn",
                mode=mode,
                slowdowns=slowdowns,
                nodes=emulated,
                allow_oversubscribe=args.allow_oversubscribe,
                run_dir=run_dir,
                server_options=(*server_options, *options),
            )
            summary = run_local(cluster)
            summary["systematic_idle"] = systematic_idle(run_dir)
            results[name].append(summary)
            final = summary.get("final") or {}
            rows.append([name, repeat, summary["idle_share"], summary["systematic_idle"],
                         final.get("oa"), summary["train_time_s"], summary["steps"],
                         shares(summary)])  # fmt: skip
    print(format_table(COLUMNS, rows))
    print()
    for name, summaries in results.items():
        idle = statistics.median(s["idle_share"] for s in summaries)
        steady = statistics.median(s["systematic_idle"] or 0.0 for s in summaries)
        oa = statistics.median((s.get("final") or {}).get("oa", 0.0) for s in summaries)
        train = statistics.median(s["train_time_s"] for s in summaries)
        print(
            f"idle_share_{name}={idle:.3f} systematic_idle_{name}={steady:.3f} "
            f"oa_{name}={oa:.4f} train_s_{name}={train:.2f}"
        )
    model = results["weighted-sync/model"]
    for base in (name for name, *_ in configs[1:]):  # paired by repeat
        ratios = [
            b["train_time_s"] / m["train_time_s"] for b, m in zip(results[base], model, strict=True)
        ]
        print(
            f"train_time_ratio_{base}_over_model={statistics.median(ratios):.2f} "
            f"(per repeat: {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    return 0
