"""Share of each worker's wall time spent waiting for training data, server pull vs local copy.

A weighted-sync run of scene-cnn on synthetic 64x64x13 scenes with a few workers, once pulling
samples from the server (the default path, prefetched one task ahead) and, with ``--local``
(the default), once more with every worker reading a copy of the file (``worker join --data``),
in this one invocation. Each worker prints ``worker NAME: ENDING after S steps, N samples,
compute C s, data wait W s, wall T s`` when it exits; this script reads those lines from
``run_dir/cluster.log`` and prints W/T per worker and the maximum per variant. The last line is
``data_wait_share=X.XXX``: the largest W/T of the server-pull run (target < 0.05).

The local-copy variant needs ``worker/loop.py`` to use ``--data``; the wired loop logs
"reading samples from local copy", and without that line the variant is reported as not
measured rather than silently measuring the server path again.

Usage: python -m bench data-wait [--samples 1500] [--slowdowns 1,1,2] [--epochs 3]
                                 [--global-batch 64] [--no-local]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.harness.record import parse_settings
from common.data.convert.synth import synth_scenes
from launch.local import LocalCluster, run_local

WORKER_LINE = re.compile(
    r"worker (?P<name>\S+): (?:[^\n]*? after )?(?P<steps>\d+) steps, (?P<samples>\d+) samples, "
    r"compute (?P<compute>[\d.]+) s, data wait (?P<wait>[\d.]+) s, wall (?P<wall>[\d.]+) s"
)
LOCAL_MARK = "reading samples from local copy"


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """One worker's final line."""

    name: str
    steps: int
    samples: int
    compute_s: float
    wait_s: float
    wall_s: float

    @property
    def share(self) -> float:
        """Data wait as a fraction of wall time."""
        return self.wait_s / max(self.wall_s, 1e-9)


def worker_results(log_text: str) -> list[WorkerResult]:
    """Parse every worker's final line from a cluster log.

    Args:
        log_text: the contents of ``run_dir/cluster.log``.

    Returns:
        One result per worker line, sorted by name.
    """
    found = {}
    for match in WORKER_LINE.finditer(log_text):
        g = match.groupdict()
        found[g["name"]] = WorkerResult(
            g["name"],
            int(g["steps"]),
            int(g["samples"]),
            float(g["compute"]),
            float(g["wait"]),
            float(g["wall"]),
        )
    return [found[name] for name in sorted(found)]


def run_variant(
    name: str,
    dataset: Path,
    run_dir: Path,
    args: argparse.Namespace,
    worker_options: tuple[str, ...],
) -> tuple[list[WorkerResult], dict[str, Any], bool]:
    """Run one weighted-sync cluster.

    Args:
        name: the variant's name, for messages.
        dataset: the server's dataset file.
        run_dir: the run directory (its cluster.log is parsed).
        args: the parsed command line.
        worker_options: extra ``worker join`` options, e.g. ``("--data", COPY)``.

    Returns:
        ``(results, summary, local)``: the workers' final lines, the run's summary, and
        whether a worker logged that it read a local copy.
    """
    slowdowns = tuple(float(s) for s in args.slowdowns.split(","))
    summary = run_local(
        LocalCluster(
            dataset=dataset,
            model="scene-cnn",
            mode="weighted-sync",
            slowdowns=slowdowns,
            run_dir=run_dir,
            server_options=(
                "--epochs",
                str(args.epochs),
                "--global-batch",
                str(args.global_batch),
                "--seed",
                "0",
            ),
            worker_options=worker_options,
            run_timeout_s=args.timeout,
        )
    )
    text = (run_dir / "cluster.log").read_text(encoding="utf-8")
    results = worker_results(text)
    if len(results) != len(slowdowns):
        raise SystemExit(f"{name}: found {len(results)} worker lines in {run_dir}/cluster.log")
    return results, summary, LOCAL_MARK in text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--slowdowns", default="1,1,2", help="one factor per worker")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1200.0, help="per run, seconds")
    parser.add_argument(
        "--local", action=argparse.BooleanOptionalAction, default=True, help="also run --data"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep run dirs under this dir")
    args = parse_settings(parser, argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        dataset = Path(tmp) / "scenes.h5"
        synth_scenes(dataset, samples=args.samples, bands=13, size=64, classes=10, seed=0)
        variants: dict[str, tuple[str, ...]] = {"server": ()}
        if args.local:
            copy = Path(tmp) / "local-copy" / "scenes.h5"
            copy.parent.mkdir()
            shutil.copyfile(dataset, copy)
            variants["local"] = ("--data", str(copy))
        maxima: dict[str, float] = {}
        train_time: dict[str, float] = {}
        for variant, options in variants.items():
            results, summary, marked = run_variant(variant, dataset, root / variant, args, options)
            if variant == "local" and not marked:
                print(
                    "local: not measured; worker/loop.py does not use --data yet "
                    f"(no {LOCAL_MARK!r} in the log)"
                )
                continue
            for r in results:
                print(
                    f"{variant:6s} {r.name:8s} steps {r.steps:4d}  samples {r.samples:5d}  "
                    f"compute {r.compute_s:6.1f} s  data wait {r.wait_s:6.2f} s  "
                    f"wall {r.wall_s:6.1f} s  share {r.share:.3f}"
                )
            maxima[variant] = max(r.share for r in results)
            train_time[variant] = float(summary["train_time_s"])
            print(
                f"{variant:6s} max share {maxima[variant]:.3f}, train time "
                f"{train_time[variant]:.1f} s, final OA {summary['final']['oa']:.3f}"
            )
        if "local" in maxima:
            print(
                f"side by side: max data-wait share server {maxima['server']:.3f}, "
                f"local {maxima['local']:.3f}; train time local/server "
                f"{train_time['local'] / train_time['server']:.2f}"
            )
            print(f"data_wait_share_local={maxima['local']:.3f}")
    print(f"data_wait_share={maxima['server']:.3f}")


if __name__ == "__main__":
    main()
