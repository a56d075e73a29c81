"""Multi-host bench: the parameter server against torch DDP (gloo) over capped links.

What it builds, runs and prints is described in docs/benchmarks.md ("Multi-host benches").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bench import ROOT
from bench.harness.record import parse_settings
from bench.multihost.config import (
    DEFAULT_VARIANTS,
    MODES,
    VARIANTS,
    BenchConfig,
    Variant,
    scenes_dataset,
)
from bench.multihost.jobs import run_gloo, run_ps
from bench.multihost.netprobe import measure_rate
from bench.multihost.report import SMALL, legend, table
from common.errors import PSError
from common.logsetup import setup_logging
from common.procs import ChildError
from launch.cluster.netns import NetConfig, Network, available
from launch.cluster.spec import rate_bits

log = logging.getLogger("multihost")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse(argv: list[str] | None) -> BenchConfig:
    """Build the config from the command line (``--help`` lists every option)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=fmt)
    add = p.add_argument
    add("--workers", type=int, default=3, help="worker hosts N")
    add("--rate", default="1gbit", help="every link's rate (tc units)")
    add("--rates", default="", help="per host, server first (N+1 rates); overrides --rate")
    names = ", ".join(v.name for v in VARIANTS)
    add("--variants", default=",".join(DEFAULT_VARIANTS), help=f"PS variants of: {names}")
    add("--model", default="resnet18", help="model for every run")
    add("--size", type=int, default=32, help="image side of the synthetic scenes")
    add("--samples", type=int, default=2000, help="scenes in the dataset")
    add("--batch", type=int, default=8, help="samples per worker per step")
    add("--steps", type=int, default=12, help="PS updates (and DDP steps) per run")
    add("--warmup", type=int, default=2, help="PS rounds left out at the start")
    add("--repeats", type=int, default=3, help="interleaved repeats of every job")
    add("--threads", type=int, default=1, help="torch threads per worker/rank")
    add("--probe-mb", type=float, default=0.0, help="MB per link check (0: 0.4 s worth)")
    add(
        "--compute-s",
        type=float,
        default=0.0,
        help="one step's compute (s) for the ratios, e.g. a GPU's; 0: fastest solo step here",
    )
    add(
        "--mode",
        choices=MODES,
        default="weighted-sync",
        help="the parameter server's mode (equal-sync: every worker in every round, as the "
        "ring's ranks)",
    )
    add(
        "--small-batch",
        type=int,
        default=1,
        help="samples per worker of each variant's small-compute run (0: none)",
    )
    add("--job-timeout", type=float, default=900.0, help="seconds one job may take")
    add("--out", type=Path, default=ROOT / "runs/multihost", help="output directory")
    add("--prefix", default="mh", help="namespace name prefix")
    a = parse_settings(p, argv)
    rates = tuple(a.rates.split(",")) if a.rates else (a.rate,) * (a.workers + 1)
    variants = tuple(v for v in a.variants.split(",") if v)
    named = {field.name: getattr(a, field.name) for field in dataclasses.fields(BenchConfig)}
    return BenchConfig(**{**named, "rates": rates, "variants": variants}).validate()


def check_links(net: Network, cfg: BenchConfig) -> list[str]:
    """Bulk transfers server -> worker and worker -> server on every worker's link."""
    lines = []
    server = net.hosts[0]
    for host in net.hosts[1:]:
        slower = min(rate_bits(server.rate), rate_bits(host.rate))
        size = int(cfg.probe_mb * 1e6) or max(1 << 20, min(64 << 20, int(slower / 8 * 0.4)))
        for src, dst in ((server, host), (host, server)):
            bits = measure_rate(src, dst, size, cfg.out / "logs")
            lines.append(
                f"link {src.netns} -> {dst.netns}: {bits / 1e6:.1f} Mbit/s of TCP payload "
                f"(cap {slower / 1e6:g} Mbit/s, {size / 1e6:.1f} MB)"
            )
    return lines


def run(cfg: BenchConfig) -> int:
    """Build the hosts, run every job, print the table; returns the exit code."""
    variants = tuple(cfg.variant(name) for name in cfg.variants)
    cfg.out.mkdir(parents=True, exist_ok=True)
    dataset = scenes_dataset(cfg.out, cfg.samples, cfg.size)
    cfg = dataclasses.replace(cfg, out=cfg.out / time.strftime("%Y%m%d-%H%M%S"))
    cfg.out.mkdir()
    gloo_runs: list[dict[str, Any]] = []
    runs = [(v, b) for v in variants for b in (cfg.batch, cfg.small_batch) if b]
    ps_runs: dict[str, list[dict[str, Any]]] = {_label(v, b, cfg): [] for v, b in runs}
    failures: dict[str, list[str]] = {}
    with Network(NetConfig(rates=cfg.rates, prefix=cfg.prefix)) as net:
        links = check_links(net, cfg)
        for line in links:
            log.info(line)
        for repeat in range(cfg.repeats):
            try:
                gloo_runs.append(run_gloo(net, cfg, dataset, cfg.out / f"gloo-r{repeat}"))
                log.info("repeat %d gloo: %s", repeat, _brief(gloo_runs[-1]))
            except ChildError as exc:
                failures.setdefault("gloo", []).append(str(exc).splitlines()[0])
                log.error("repeat %d gloo failed: %s", repeat, exc)
            for variant, batch in runs:
                name = _label(variant, batch, cfg)
                run_dir = cfg.out / f"{name}-r{repeat}"
                try:
                    ps_runs[name].append(run_ps(net, cfg, variant, dataset, run_dir, batch))
                    log.info("repeat %d %s: %s", repeat, name, _brief(ps_runs[name][-1]))
                except ChildError as exc:
                    failures.setdefault(name, []).append(str(exc).splitlines()[0])
                    log.error("repeat %d %s failed: %s", repeat, name, exc)
    text, figures = table(cfg, gloo_runs, ps_runs, failures)
    params = gloo_runs[0]["params"] if gloo_runs else None
    print("\n".join(links))
    print(text)
    print(legend(cfg, figures, params))
    print(figure_lines(figures))
    print(f"run folders and logs: {cfg.out}")
    return 1 if failures else 0


def figure_lines(figures: dict[str, Any]) -> str:
    """The table's headline figures as ``name=value`` words: the reference, then per variant
    (and its ``-small`` run) its median round, communication, slowest worker's compute, ratio
    to all-reduce + compute and communication over the all-reduce's."""
    words = [f"{k}={v:.4f}" for k, v in (figures.get("reference") or {}).items()]
    for name, row in figures["variants"].items():
        words.append(f"round_s_{name}={row['round_s']['median']:.4f}")
        words.append(f"comm_s_{name}={row['comm_s_median']:.4f}")
        words.append(f"compute_s_{name}={row['compute_s_median']:.4f}")
        if "ratio_reference" in row:
            words.append(f"ratio_{name}={row['ratio_reference']:.3f}")
            words.append(f"comm_over_ring_{name}={row['ratio_comm_allreduce']:.3f}")
    return "\n".join(words)


def _label(variant: Variant, batch: int, cfg: BenchConfig) -> str:
    """A run's row name: the variant's, with ``-small`` for its small-compute run."""
    return variant.name if batch == cfg.batch else f"{variant.name}{SMALL}"


def _brief(result: dict) -> str:
    keys = ("allreduce_s", "ddp_step_s", "round_s", "comm_s")
    parts = [f"{k} {sorted(result[k])[len(result[k]) // 2]:.3f}" for k in keys if result.get(k)]
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 0 when every job ran (or the bench cannot run here)."""
    setup_logging("INFO", "multihost ")
    try:
        cfg = parse(argv)
    except PSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reason = available()
    if reason:
        print(f"skipped: {reason} (the bench builds network namespaces)")
        return 0
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    started = time.monotonic()
    try:
        code = run(cfg)
    except KeyboardInterrupt:
        log.error("interrupted; every namespace and process was removed")
        return 130
    except (PSError, OSError, subprocess.SubprocessError) as exc:
        log.error("%s", exc)
        return 1
    log.info("done in %.0f s", time.monotonic() - started)
    return code
