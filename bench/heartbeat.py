"""Round-time overhead of heartbeats: weighted-sync rounds with heartbeats every 1 s (the
default) and every 0.05 s, against heartbeats practically off (every 1000 s), in one run.

Usage: python -m bench heartbeat [--rounds 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.harness.record import parse_settings
from common.data.convert.synth import synth_hsi
from launch.local import LocalCluster, run_local

SETTINGS = {
    "off (1000 s)": ("1000", "2000"),
    "default (1 s)": ("1", "5"),
    "aggressive (0.05 s)": ("0.05", "5"),
}
WARMUP = 10


def median_round(run_dir: Path) -> float:
    """Median ``round_s`` of a run after the warm-up rounds."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rounds = [json.loads(x)["round_s"] for x in lines if '"event": "round"' in x][WARMUP:]
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_settings(parser, argv)
    results: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "hsi.h5"
        synth_hsi(dataset, bands=32, size=48, classes=5, train_fraction=0.5, seed=0)
        for repeat in range(args.repeats):
            for name, (beat, dead) in SETTINGS.items():
                run_dir = Path(tmp) / f"{repeat}-{beat}"
                run_local(
                    LocalCluster(
                        dataset=dataset,
                        model="hsi-cnn",
                        mode="weighted-sync",
                        slowdowns=(1.0, 2.0),
                        run_dir=run_dir,
                        server_options=(
                            "--max-steps",
                            str(args.rounds + WARMUP),
                            "--heartbeat",
                            beat,
                            "--dead-after",
                            dead,
                        ),
                    )
                )
                results[name].append(median_round(run_dir))
    base = statistics.median(results["off (1000 s)"])
    for name, times in results.items():
        med = statistics.median(times)
        print(
            f"heartbeat {name:20s} median round {med * 1e3:6.2f} ms "
            f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}); "
            f"ratio to off {med / base:.3f}"
        )
    print(f"ratio_default={statistics.median(results['default (1 s)']) / base:.3f}")


if __name__ == "__main__":
    main()
