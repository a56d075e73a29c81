"""Time to a target OA on Jasper Ridge: every mode and a single-process reference, two regimes.

The heavy regime trains on 50 % of each class: evaluating the 90 % test split of an 11x11
dataset costs more than an epoch of training, and the server evaluates beside its workers on
the same cores. DDP, equal-sync and single follow the same trajectory in every repeat of one
seed, while weighted-sync and async (whose plans follow the measured speeds) draw a new one each
time; repeat r uses seed ``--seed`` + r - 1 so that every mode's trajectory is sampled.

Time to target is the training time at which the first snapshot at or above the target was
produced: snapshots every ``--snapshot-every`` updates (async: that many times the worker count
in pushes), scored after the run on the whole test split. ``python -m bench own-ground`` is this
bench with ``OWN_GROUND``'s defaults.
"""

from __future__ import annotations

import argparse
import json
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
from bench.harness.jasper import jasper, jasper_missing
from bench.harness.record import parse_settings
from bench.harness.stats import paired, ratio, spread_text
from common.logsetup import setup_logging
from common.training.rounds import round_events
from common.training.tables import format_table
from launch.cluster.spec import PRESETS, parse_cluster
from launch.compare import COMPARE_MODES, CompareConfig, run_compare
from launch.settings import TrainSettings

MODES = ("weighted-sync", "equal-sync", "async", "ddp", "single")
STATIC = "static"
OWN_GROUND = {
    "modes": "weighted-sync,equal-sync,async,ddp,ddp-kept,weighted-ddp,weighted-ddp-rebalance",
    "clusters": f"{STATIC},shifting-load,leave-return",
    "cluster": "small-1124",
    "repeats": 3,
    "out": ROOT / "runs/bench/own_ground",
}
REGIMES = {
    # name: (patch, train fraction, global batch, lr schedule, epochs, target OA)
    "small": (5, 0.1, 64, "constant", 6, 0.90),
    "heavy": (11, 0.5, 128, "cosine", 4, 0.84),
}


def exactly_once(run: dict) -> bool | None:
    """Whether every epoch event of the run says each sample was used exactly once (None: its
    epoch events do not say)."""
    with (Path(run["run_dir"]) / "metrics.jsonl").open(encoding="utf-8") as f:
        flags = [e["exactly_once"] for e in map(json.loads, f) if "exactly_once" in e]
    return all(flags) if flags else None


def step_compute_ms(run: dict) -> float:
    """Median compute time of one step of the first rank, from the run's round records."""
    firsts = [e["workers"][0] for e in round_events(Path(run["run_dir"]))]
    times = [first["compute_s"] for first in firsts if "compute_s" in first]
    return 1000 * statistics.median(times) if times else float("nan")


def finished(config: CompareConfig) -> dict | None:
    """The compare.json of a repeat that already ran every mode with the same data, model,
    slowdowns, training settings, target and snapshots (None: it has to run)."""
    path = config.out / "compare.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    wanted = json.loads(json.dumps(config.settings()))
    keys = (
        "dataset", "model", "modes", "slowdowns", "train", "target_oa", "snapshot_every",
        "worker_options", "cluster",
    )  # fmt: skip
    same = all(data.get("settings", {}).get(k) == wanted.get(k) for k in keys)
    complete = {r["mode"] for r in data.get("runs", [])} == set(config.modes)
    return data if same and complete and "max_drop" in data else None


def run_regime(name: str, cluster: str, args: argparse.Namespace) -> tuple[list[str], list[dict]]:
    """Compare every mode in one regime on one cluster; print its table; return its figure
    lines and its runs."""
    patch, fraction, batch, schedule, epochs, target = REGIMES[name]
    out = args.out / name if cluster == STATIC else args.out / cluster / name
    out.mkdir(parents=True, exist_ok=True)
    epochs = args.epochs or epochs
    target = args.target_oa or target
    data = jasper(args.out, patch, fraction)
    if cluster == STATIC:
        count = worker_count(args, args.slowdowns)
        emulated = cluster_from_args(args, count)
    else:
        count = len(PRESETS[cluster].node_cpus)
        emulated = parse_cluster(count, preset=cluster)
    label = _label(cluster, name)
    text = args.slowdowns or ("1" if emulated is not None else "1,1,2,4")
    slowdowns = tuple(float(s) for s in text.split(","))
    slowdowns = slowdowns * count if len(slowdowns) == 1 else slowdowns
    modes = tuple(m.strip() for m in args.modes.split(","))
    seeds = [args.seed + (0 if args.same_seed else r) for r in range(args.repeats)]
    runs = []
    for repeat, seed in enumerate(seeds, start=1):
        config = CompareConfig(
            dataset=data,
            model="hsi-cnn",
            modes=modes,
            slowdowns=slowdowns,
            out=out / f"repeat{repeat}-seed{seed}",
            train=TrainSettings(epochs=epochs, global_batch=batch, lr_schedule=schedule, seed=seed),
            target_oa=target,
            snapshot_every=args.snapshot_every or None,
            nodes=emulated,
            allow_oversubscribe=args.allow_oversubscribe,
            worker_options=("--data", str(data)) if args.worker_data else (),
        )
        done = finished(config) if args.reuse else None
        found = done or run_compare(config, show_progress=sys.stderr.isatty())
        for run in found["runs"]:
            runs.append({**run, "repeat": repeat})
    rows, lines = [], []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode and "error" not in r]
        finals = [r["summary"]["final"] for r in mine]
        reached = sum(r["time_to_target_s"] is not None for r in mine)
        drops = [r["max_drop"] for r in mine if r.get("max_drop") is not None]
        rows.append(
            [
                mode,
                f"{len(mine)} ({reached} reached)",
                spread_text([r["epoch_time_s"] for r in mine]),
                spread_text([r["time_to_target_s"] for r in mine], 2),
                spread_text(drops),
                *(spread_text([f[k] for f in finals], 4) for k in ("oa", "aa", "kappa")),
            ]
        )
        tag, flags = f"{label}_{_name(mode)}", [exactly_once(r) for r in mine]
        if drops:
            lines.append(f"max_drop_{tag}_median={statistics.median(drops):.3f}")
            lines.append(f"max_drop_{tag}_max={max(drops):.3f}")
        if finals:
            lines.append(f"final_oa_{tag}_median={statistics.median(f['oa'] for f in finals):.4f}")
            lines.append(f"runs_{tag}={len(finals)}")
        if any(f is not None for f in flags):
            lines.append(f"exactly_once_{tag}={int(all(flags))}")
        if mode == "single" and mine:
            step_ms = statistics.median(map(step_compute_ms, mine))
            lines.append(f"step_compute_ms_{label}_single={step_ms:.1f}")
    print(
        f"\n== {name}{'' if cluster == STATIC else f' on {cluster}'}: hsi-cnn, Jasper Ridge "
        f"{patch}x{patch} patches, {fraction:.0%} train, "
        f"B={batch}, {schedule} lr, {epochs} epochs, target OA {target}, "
        f"slowdowns {','.join(f'{x:g}' for x in slowdowns)}, {args.repeats} repeats "
        + f"(seeds {seeds[0]}-{seeds[-1]}) (min / median / max); time to target from "
        + (f"snapshots every {args.snapshot_every} updates" if args.snapshot_every else "epochs")
    )
    headers = ["mode", "runs", "epoch time s", "time to target s", "max OA drop", "final OA"]
    print(f"on {cluster_label(emulated)}")
    if args.worker_data:
        print("workers read a local copy of the dataset (worker join --data), as DDP's ranks do")
    print(format_table([*headers, "AA", "kappa"], rows))
    pairs = [(m, "ddp") for m in modes if m != "ddp"]
    if "weighted-sync" in modes:
        pairs += [("weighted-sync", b) for b in modes if b not in ("weighted-sync", "ddp")]
    for mode, base in pairs:
        for key, quantity in (("time_to_target_s", "ttt"), ("epoch_time_s", "epoch")):
            ratios = paired(runs, mode, base, ratio(key))
            value = f"{statistics.median(ratios):.2f}" if ratios else "nan"
            lines.append(f"ratio_{label}_{quantity}_{_name(mode)}_vs_{_name(base)}={value}")
    return lines, runs


def _name(mode: str) -> str:
    """A mode as figure names spell it."""
    return mode.replace("-", "_")


def _label(cluster: str, regime: str) -> str:
    """How figure names name a regime on a cluster: the regime alone on ``static``."""
    return regime if cluster == STATIC else _name(f"{cluster}_{regime}")


def final_oa_diffs(label: str, runs: list[dict], static: list[dict]) -> list[str]:
    """Per mode, the median over seeds of a run's final OA less the static cluster's run of the
    same mode and seed, as ``final_oa_diff_<label>_<mode>_vs_static`` lines."""
    base = {(r["mode"], r["repeat"]): r for r in static if "error" not in r}
    diffs: dict[str, list[float]] = {}
    for run in runs:
        other = base.get((run["mode"], run["repeat"]))
        if "error" not in run and other is not None:
            mine, theirs = run["summary"]["final"]["oa"], other["summary"]["final"]["oa"]
            diffs.setdefault(run["mode"], []).append(mine - theirs)
    return [
        f"final_oa_diff_{label}_{_name(mode)}_vs_static={statistics.median(values):+.4f}"
        for mode, values in diffs.items()
    ]


def main(argv: list[str] | None = None, defaults: dict | None = None) -> int:
    """Run the regimes on each cluster and print their tables, then every figure line.

    Args:
        argv: the options (None: the command line's).
        defaults: other defaults for the options (``OWN_GROUND`` for ``own-ground``).
    """
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add("--repeats", type=int, default=1, help="runs per mode")
    add("--regimes", default="small,heavy", help="regimes")
    add(
        "--slowdowns",
        help="worker slowdowns (none: 1,1,2,4 on shared cores, 1 on an emulated cluster)",
    )
    add("--epochs", type=int, help="epochs (none: the regime's)")
    add("--target-oa", type=float, help="target OA (none: the regime's)")
    add("--modes", default=",".join(MODES), help="modes to compare, among pslaunch compare's")
    add_cluster_arguments(parser)
    add(
        "--clusters",
        default=STATIC,
        help=f"clusters to run each regime on: {STATIC} (--cluster or --node-cpus, else shared "
        f"cores) or presets among {', '.join(sorted(PRESETS))}",
    )
    add(
        "--snapshot-every",
        type=int,
        default=2,
        help="updates between snapshots for time to target (0: per-epoch evaluations)",
    )
    add(
        "--worker-data",
        action="store_true",
        help="parameter-server workers read a local copy of the dataset (worker join --data), "
        "as DDP's ranks do, instead of pulling samples from the server",
    )
    add("--seed", type=int, default=0, help="seed of the first repeat")
    add("--same-seed", action="store_true", help="every repeat uses --seed (else seed + r - 1)")
    add("--out", type=Path, default=ROOT / "runs/bench/time_to_target", help="output directory")
    add(
        "--reuse",
        action="store_true",
        help="take a repeat whose compare.json already holds every mode with the same settings "
        "from --out instead of running it again",
    )
    parser.set_defaults(**(defaults or {}))
    args = parse_settings(parser, argv)
    setup_logging("WARNING")
    clusters = [c.strip() for c in args.clusters.split(",")]
    missing = [m for m in args.modes.split(",") if m.strip() not in COMPARE_MODES]
    unknown = [c for c in clusters if c != STATIC and c not in PRESETS]
    if missing or unknown:
        print(
            f"not modes of this build's pslaunch compare: {', '.join(missing) or '-'}; not "
            f"clusters: {', '.join(unknown) or '-'} (modes: {', '.join(COMPARE_MODES)})"
        )
        return 2
    if (reason := jasper_missing()) is not None:
        print(reason)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    lines, runs = [], {}
    for cluster in clusters:
        for name in (n.strip() for n in args.regimes.split(",")):
            found, runs[cluster, name] = run_regime(name, cluster, args)
            lines += found
            if cluster != STATIC and (STATIC, name) in runs:
                lines += final_oa_diffs(
                    _label(cluster, name), runs[cluster, name], runs[STATIC, name]
                )
    print()
    print("\n".join(lines))
    return 0


def own_ground(argv: list[str] | None = None) -> int:
    """``python -m bench own-ground``: ``main`` with the ``OWN_GROUND`` defaults."""
    return main(argv, OWN_GROUND)
