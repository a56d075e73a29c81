"""Multi-host training end to end: weighted-sync against DDP on the same emulated hosts and links.

The modes, data and figures are described in docs/benchmarks.md ("Multi-host benches").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.harness.cluster import add_cluster_arguments, cluster_from_args
from bench.harness.record import parse_settings
from bench.harness.stats import spread_text
from bench.multihost.config import hsi_dataset, scenes_dataset
from common.errors import PSError
from common.logsetup import setup_logging
from common.training.rounds import breakdown, round_events
from launch.cluster.netns import available
from launch.cluster.spec import PRESETS, ClusterSpec
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.local import LocalCluster, run_local
from launch.settings import TrainSettings
from launch.slowdowns import parse_slowdowns
from pserver.config import SCHEDULES

log = logging.getLogger("mh_train")
MODES = ("ws-bf16", "ddp-fp32", "ddp-bf16")
RUN_TIMEOUT_S = 1800.0


def run_mode(
    mode: str,
    args: argparse.Namespace,
    dataset: Path,
    spec: ClusterSpec,
    slowdowns: tuple[float, ...],
    seed: int,
    run_dir: Path,
) -> dict[str, Any]:
    """One run of ``mode`` through the launcher; its summary."""
    train = TrainSettings(
        epochs=args.epochs,
        global_batch=args.global_batch,
        lr_schedule=args.lr_schedule,
        seed=seed,
    )
    if mode == "ws-bf16":
        cluster = LocalCluster(
            dataset=dataset,
            model=args.model,
            mode="weighted-sync",
            slowdowns=slowdowns,
            run_dir=run_dir,
            server_options=(*train.server_args(), "--wire-dtype", "bf16"),
            worker_options=("--threads", "1"),
            shards=len(slowdowns),
            run_timeout_s=RUN_TIMEOUT_S,
            nodes=spec,
            allow_oversubscribe=args.allow_oversubscribe,
        )
        return run_local(cluster)
    config = DDPConfig(
        dataset=dataset,
        model=args.model,
        slowdowns=slowdowns,
        run_dir=run_dir,
        train=train,
        run_timeout_s=RUN_TIMEOUT_S,
        nodes=spec,
        allow_oversubscribe=args.allow_oversubscribe,
        grad_compression="bf16" if mode == "ddp-bf16" else "none",
    )
    return run_ddp(config)


def step_split(run_dir: Path) -> tuple[float, float]:
    """Medians over the run's rounds of the slowest node's compute and of the rest of the
    round (DDP's emulated compute counts its slowdown; a PS worker's compute_s does)."""
    compute, rest = [], []
    for event in round_events(run_dir):
        slowest = max(w.compute_s for w in breakdown(event))
        compute.append(slowest)
        rest.append(float(event["round_s"]) - slowest)
    return statistics.median(compute), statistics.median(rest)


def main(argv: list[str] | None = None) -> int:
    """Run every mode ``--repeats`` times, print the table and the ratios; exit code 0 when
    every run finished (or the bench cannot run here)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=fmt)
    add = p.add_argument
    add("--workers", type=int, default=3, help="worker hosts (DDP ranks)")
    add("--links", help="every node's link rate (tc units) (default: the preset's, else 1gbit)")
    add(
        "--slowdowns",
        help="slowdown per worker (and rank) (default: 1,1,2 without budgets, 1 with them)",
    )
    add_cluster_arguments(p)
    add("--model", default="resnet18", help="model for every run")
    add(
        "--data",
        choices=("hsi", "scenes"),
        default="hsi",
        help="synthetic hyperspectral patches (32 bands, 6 classes) or 3-band scenes (10 classes)",
    )
    add("--size", type=int, help="hsi: the scene's side (default 64); scenes: image side (32)")
    add("--patch", type=int, default=11, help="hsi: patch side")
    add("--samples", type=int, default=750, help="scenes: images (80 %% train)")
    add("--global-batch", type=int, default=36, help="global batch B")
    add("--epochs", type=int, default=3, help="epochs per run")
    add("--lr-schedule", choices=SCHEDULES, default="cosine", help="for every run")
    add("--repeats", type=int, default=2, help="interleaved repeats (seed = repeat)")
    add("--modes", default=",".join(MODES), help=f"among {', '.join(MODES)}")
    add("--out", type=Path, default=ROOT / "runs/mh_train", help="output directory")
    args = parse_settings(p, argv)
    setup_logging("INFO", "mh_train ")
    reason = available()
    if reason:
        print(f"skipped: {reason} (the bench builds network namespaces)")
        return 0
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    modes = tuple(m for m in args.modes.split(",") if m)
    links = args.links or (None if args.cluster and PRESETS[args.cluster].links else "1gbit")
    spec = cluster_from_args(args, args.workers, links)
    assert spec is not None
    default_slowdowns = "1" if spec.budgets else "1,1,2"
    slowdowns = parse_slowdowns(args.slowdowns or default_slowdowns, len(spec.workers))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.data == "hsi":
        dataset = hsi_dataset(args.out, args.size or 64, args.patch)
        data_line = f"hsi {args.size or 64}px scene, {args.patch}x{args.patch} patches"
    else:
        dataset = scenes_dataset(args.out, args.samples, args.size or 32)
        data_line = f"scenes {args.size or 32}px x {args.samples}"
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    failures: list[str] = []
    started = time.monotonic()
    for repeat in range(args.repeats):
        for mode in modes:
            run_dir = out / f"{mode}-r{repeat}"
            try:
                summary = run_mode(mode, args, dataset, spec, slowdowns, repeat, run_dir)
            except PSError as exc:
                failures.append(f"{mode} r{repeat}: {exc}")
                log.error("%s r%d failed: %s", mode, repeat, exc)
                continue
            compute, rest = step_split(run_dir)
            record = {
                "epoch_time_s": summary["train_time_s"] / summary["epochs"],
                "oa": summary["final"]["oa"],
                "slowest_compute_s": compute,
                "rest_of_step_s": rest,
                "batches": {w["name"]: w["samples"] for w in summary["workers"]},
                "run_dir": str(run_dir),
            }
            runs[mode].append(record)
            log.info("%s r%d: %s", mode, repeat, json.dumps(record))
    print(
        f"multi-host training: {len(spec.workers)} worker hosts + server host, "
        f"{spec.summary_line()}, slowdowns {','.join(f'{x:g}' for x in slowdowns)}, "
        f"{args.model}, {data_line}, B={args.global_batch}, {args.epochs} epochs, "
        f"lr schedule {args.lr_schedule}, {args.repeats} repeats, "
        f"{time.monotonic() - started:.0f} s"
    )
    print(
        "mode | epoch time s (min / median / max) | final OA | slowest compute per step s | "
        "rest of step s"
    )
    for mode, records in runs.items():
        if records:
            print(
                f"{mode} | {spread_text([r['epoch_time_s'] for r in records], 2)} | "
                f"{spread_text([r['oa'] for r in records], 4)} | "
                f"{statistics.median(r['slowest_compute_s'] for r in records):.3f} | "
                f"{statistics.median(r['rest_of_step_s'] for r in records):.3f}"
            )
    if runs.get("ws-bf16"):
        ws_epoch = statistics.median(r["epoch_time_s"] for r in runs["ws-bf16"])
        ws_oa = statistics.median(r["oa"] for r in runs["ws-bf16"])
        for mode in ("ddp-fp32", "ddp-bf16"):
            if runs.get(mode):
                epoch = statistics.median(r["epoch_time_s"] for r in runs[mode])
                oa = statistics.median(r["oa"] for r in runs[mode])
                print(f"ratio_epoch_{mode.replace('-', '_')}_vs_ws={epoch / ws_epoch:.2f}")
                print(f"oa_diff_{mode.replace('-', '_')}_vs_ws={ws_oa - oa:+.4f}")
    for line in failures:
        print(f"failed: {line}")
    return 1 if failures else 0
