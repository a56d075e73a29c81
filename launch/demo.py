"""``make demo``: a local server with heterogeneous workers training on remote-sensing data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.logsetup import setup_logging
from launch.local import LocalCluster, run_local
from launch.table import format_table

MODES = ("weighted-sync", "equal-sync", "async")
SLOWDOWNS = (1.0, 2.0, 4.0)


class ProgressFilter:
    """A text sink that shows only the server's per-epoch evaluation lines."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def write(self, text: str) -> None:
        if "OA " in text and text.startswith("[server]"):
            sys.stdout.write(f"  {self.mode:13s} {text.split(': ', 1)[-1]}")
            sys.stdout.flush()

    def flush(self) -> None:
        sys.stdout.flush()


def prepare_dataset(shared: Path, out_dir: Path) -> Path:
    """Jasper Ridge from ``shared`` when present, else a synthetic hyperspectral scene."""
    from common.data.convert.hsi import prepare_hsi
    from common.data.convert.synth import synth_hsi

    out_dir.mkdir(parents=True, exist_ok=True)
    jasper = shared / "datasets" / "jasper_ridge"
    if (jasper / "JasperRidge.mat").exists():
        path = out_dir / "jasper_ridge.h5"
        if not path.exists():
            prepare_hsi(
                str(jasper / "JasperRidge.mat"),
                str(jasper / "JasperRidge_gt.mat"),
                path,
                patch=5,
                train_fraction=0.1,
                seed=0,
            )
        print(f"dataset: Jasper Ridge (AVIRIS, 198 bands, 5x5 patches, 10 % train) -> {path}")
    else:
        path = out_dir / "synthetic_hsi.h5"
        if not path.exists():
            synth_hsi(path, seed=0)
        print(f"dataset: {jasper} not found; using a synthetic hyperspectral scene -> {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    """Run every mode on the same data and workers and print a comparison table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shared", type=Path, default=Path("../shared"))
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    setup_logging("WARNING")
    dataset = prepare_dataset(args.shared, args.out)
    rows = []
    for mode in MODES:
        print(f"\n== {mode}: 3 workers with slowdowns {', '.join(f'{s:g}' for s in SLOWDOWNS)}")
        cluster = LocalCluster(
            dataset=dataset,
            model="hsi-cnn",
            mode=mode,
            slowdowns=SLOWDOWNS,
            run_dir=args.out / mode,
            server_options=(
                "--epochs",
                str(args.epochs),
                "--lr",
                "0.05",
                "--lr-schedule",
                "cosine",
            ),
        )
        summary = run_local(cluster, log_stream=ProgressFilter(mode))
        final = summary["final"] or {}
        shares = " ".join(
            f"x{w['slowdown']:g}:{w['samples']}"
            for w in sorted(summary["workers"], key=lambda w: w["slowdown"])
        )
        rows.append(
            [
                mode,
                summary["epochs"],
                summary["steps"],
                summary["train_time_s"],
                final.get("oa"),
                final.get("aa"),
                final.get("kappa"),
                shares,
            ]
        )
    print("\nResults (test split; samples trained per worker, by slowdown):")
    print(
        format_table(
            ["mode", "epochs", "updates", "train s", "OA", "AA", "kappa", "samples per worker"],
            rows,
        )
    )
    print(f"\nRun directories with metrics.jsonl and summary.json: {args.out}/<mode>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
