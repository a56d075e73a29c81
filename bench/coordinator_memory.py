"""Coordinator peak memory while serving a large dataset: peak resident set size of
``pserver start`` on a ~1.7 GB synthetic scenes file (8000 images of 13 x 64 x 64 float32) with
``--cache-mb 256`` (the file does not fit, so every read goes to the file), weighted-sync with
workers pulling their samples from it, then the final evaluation on the whole test split
(1600 scenes).

The peak is the server's VmHWM, read every 0.2 s until it exits. One worker by default: its
rounds do not depend on measured speeds, so a ``--baseline`` run trains the same model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.harness.record import parse_settings
from bench.harness.served import served_run
from common.data.convert.synth import synth_scenes
from launch.procs import new_events

SAMPLE_S = 0.2


def status_mb(pid: int, key: str) -> float:
    """A ``/proc/PID/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def measure(data: Path, run_dir: Path, code: Path, args: argparse.Namespace) -> dict:
    """One job whose processes import ``code``.

    Returns:
        ``{"peak_mb", "training_peak_mb", "final"}``: the server's peak RSS over the run and
        until the last round, and the summary's final scores.
    """
    peak, training_peak = 0.0, None
    options = [
        *("--dataset", str(data), "--model", args.model, "--mode", "weighted-sync"),
        *("--workers", str(args.workers), "--global-batch", str(args.batch * args.workers)),
        *("--max-steps", str(args.steps), "--cache-mb", str(args.cache_mb), "--seed", "1"),
        *("--shutdown-timeout", "900"),  # the final evaluation runs within it
    ]
    with served_run(
        code, run_dir, options, args.workers, start_timeout_s=300, stop_grace_s=120
    ) as run:
        while run.server.code is None:
            try:
                peak = max(peak, status_mb(run.server.popen.pid, "VmHWM"))
            except (OSError, RuntimeError):
                break
            if training_peak is None:
                rounds = [e for e in new_events(run.metrics, run.mark) if e.get("event") == "round"]
                if len(rounds) >= args.steps:
                    training_peak = peak
            time.sleep(SAMPLE_S)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    return {"peak_mb": peak, "training_peak_mb": training_peak, "final": summary["final"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8000, help="scenes in the file")
    parser.add_argument("--model", default="scene-cnn")
    parser.add_argument("--cache-mb", type=int, default=256, help="the server's --cache-mb")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16, help="samples per worker per step")
    parser.add_argument("--steps", type=int, default=20, help="the server's --max-steps")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--data", type=Path, default=None, help="an existing dataset file")
    parser.add_argument("--dir", type=Path, default=None, help="where temporary files go")
    args = parse_settings(parser, argv)
    with tempfile.TemporaryDirectory(prefix="bench-coord-mem-", dir=args.dir) as tmp:
        root = Path(tmp)
        data = args.data
        if data is None:
            data = root / "scenes.h5"
            synth_scenes(data, samples=args.samples, bands=13, size=64, classes=10, seed=0)
        size_mb = data.stat().st_size / 2**20
        print(f"dataset {data}: {size_mb:.0f} MiB; --cache-mb {args.cache_mb}, {args.model}")
        runs = [("this checkout", ROOT)]
        if args.baseline is not None:
            runs.append((f"baseline {args.baseline}", args.baseline.resolve()))
        for i, (name, code) in enumerate(runs):
            result = measure(data, root / f"run{i}", code, args)
            final = result["final"] or {"oa": float("nan"), "loss": float("nan")}
            training = result["training_peak_mb"]
            print(
                f"{name}: server peak RSS {result['peak_mb']:.0f} MiB "
                f"(until the last round {training or float('nan'):.0f} MiB); "
                f"final OA {final['oa']:.6f} loss {final['loss']:.6f}",
                flush=True,
            )
            if i == 0:
                print(f"peak_mb={result['peak_mb']:.0f} final_oa={final['oa']:.6f}")
                if training:
                    print(f"training_peak_mb={training:.0f}")
