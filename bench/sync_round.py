"""Round time of weighted-sync against equal-sync on two workers with slowdowns 1 and 3.

Both modes run in this one invocation on the same synthetic 64x64x13 scenes with scene-cnn.
Equal-sync gives each worker B/2 and waits for the slow one (3 x B/2 sample-times); weighted-
sync gives the fast worker 3B/4 and the slow one B/4 (3/4 B sample-times each), so the ideal
ratio is 2.0. The last line is ``ratio=X.XX`` (median equal-sync round / median weighted-sync
round).

Usage: python -m bench sync-round [--rounds 40] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.harness.record import parse_settings
from common.data.convert.synth import synth_scenes
from launch.local import LocalCluster, run_local

SLOWDOWNS = (1.0, 3.0)
WARMUP_ROUNDS = 5


def round_times(run_dir: Path) -> tuple[list[float], list[list[int]]]:
    """Round durations and batch plans from a run's metrics.jsonl, after the warm-up rounds."""
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rounds if r["event"] == "round"][WARMUP_ROUNDS:]
    return [r["round_s"] for r in rounds], [[w["batch"] for w in r["workers"]] for r in rounds]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=64)
    args = parse_settings(parser, argv)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "scenes.h5"
        synth_scenes(dataset, samples=1200, bands=13, size=64, classes=10, seed=0)
        medians: dict[str, list[float]] = {"weighted-sync": [], "equal-sync": []}
        for repeat in range(args.repeats):
            for mode in medians:
                run_dir = Path(tmp) / f"{mode}-{repeat}"
                run_local(
                    LocalCluster(
                        dataset=dataset,
                        model="scene-cnn",
                        mode=mode,
                        slowdowns=SLOWDOWNS,
                        run_dir=run_dir,
                        server_options=(
                            "--max-steps",
                            str(args.rounds + WARMUP_ROUNDS),
                            "--global-batch",
                            str(args.global_batch),
                        ),
                    )
                )
                times, plans = round_times(run_dir)
                medians[mode].append(statistics.median(times))
                print(
                    f"{mode:13s} repeat {repeat}: median round {medians[mode][-1] * 1e3:.1f} ms,"
                    f" last batch plan (fast, slow) {plans[-1]}"
                )
    weighted = statistics.median(medians["weighted-sync"])
    equal = statistics.median(medians["equal-sync"])
    print(f"slowdowns {SLOWDOWNS}, global batch {args.global_batch}, scene-cnn on 64x64x13")
    print(
        f"weighted-sync median round: {weighted * 1e3:.1f} ms; "
        f"equal-sync: {equal * 1e3:.1f} ms (ideal ratio 2.00)"
    )
    print(f"ratio={equal / weighted:.2f}")


if __name__ == "__main__":
    main()
