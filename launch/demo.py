"""``make demo``: a local server with heterogeneous workers training on remote-sensing data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common import rundir
from common.logsetup import setup_logging
from common.training.tables import (
    MODEL_COLUMNS,
    PLAN_LEGEND,
    format_table,
    legend,
    model_cells,
    oa_text,
    score,
    seconds,
)
from launch.local import LocalCluster, run_local
from launch.progress import RunProgress, eval_label

MODES = ("weighted-sync", "equal-sync", "async")
SLOWDOWNS = (1.0, 2.0, 4.0)
SCHEDULE = ("--lr", "0.05", "--lr-schedule", "cosine")
RESULT_COLUMNS = ("mode", "epochs", "updates", "train s", "OA", "AA", "kappa", "idle share",
                  "share by slowdown")  # fmt: skip
PROGRESS_LEGEND = (
    "Each line is one evaluation on the test split: 'epoch E version V' is the model after E "
    "epochs and V updates (one update per round in sync modes, one per push in async)."
)
TABLE_LEGEND = (
    "updates: model versions applied; train s: training wall time without start-up and "
    "evaluations; OA, AA, kappa: final test overall accuracy, mean per-class accuracy and "
    "Cohen's kappa; share by slowdown: the part of all training samples each worker computed "
    "(x4 is four times slower than x1): weighted-sync gives each the share that makes the "
    "workers' predicted round times equal (less than 4:2:1 for slow workers, whose fixed "
    "costs per round count too), equal-sync the same to all and lets fast ones wait, async "
    "what each finishes; idle share: the workers' time waiting at the round barrier over "
    "their round time (sync modes)."
)


class EvaluationLines(RunProgress):
    """Prints each evaluation of a run as its server records it in ``metrics.jsonl`` (no bar)."""

    def __init__(self, mode: str) -> None:
        super().__init__(None, None, enabled=False)
        self.mode = mode

    def feed(self, record: dict[str, Any]) -> None:
        super().feed(record)
        if record.get("event") == "eval" and isinstance(record.get("oa"), int | float):
            names = {"aa": "AA", "kappa": "kappa", "loss": "loss"}
            scores = " ".join(f"{name} {record.get(key, 0):.4f}" for key, name in names.items())
            print(f"  {self.mode:13s} {eval_label(record)}: {oa_text(record)} {scores}", flush=True)


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
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace the runs of an earlier demo in --out (make demo passes it).",
    )
    args = parser.parse_args(argv)
    setup_logging("WARNING")
    earlier = [args.out / m for m in MODES if rundir.started(args.out / m)]
    if earlier and not args.overwrite:
        print(f"demo: {earlier[0]} holds an earlier run; give --overwrite to replace it")
        return 2
    dataset = prepare_dataset(args.shared, args.out)
    print(legend(PROGRESS_LEGEND))
    rows = []
    plans: list[list[Any]] = []
    for mode in MODES:
        print(f"\n== {mode}: 3 workers with slowdowns {', '.join(f'{s:g}' for s in SLOWDOWNS)}")
        cluster = LocalCluster(
            dataset=dataset,
            model="hsi-cnn",
            mode=mode,
            slowdowns=SLOWDOWNS,
            run_dir=args.out / mode,
            server_options=("--epochs", str(args.epochs), *SCHEDULE),
            overwrite=args.overwrite,
        )
        summary = run_local(cluster, progress=EvaluationLines(mode))
        final = summary["final"] or {}
        workers = sorted(summary["workers"], key=lambda w: w["slowdown"])
        total = sum(w["samples"] for w in workers) or 1
        shares = " ".join(f"x{w['slowdown']:g} {100 * w['samples'] / total:.0f}%" for w in workers)
        plans.extend(
            [mode, f"x{w['slowdown']:g}", f"{w['samples'] / total:.3f}", *model_cells(w)]
            for w in workers
        )
        rows.append(
            [
                mode,
                summary["epochs"],
                summary["steps"],
                seconds(summary["train_time_s"]),
                score(final.get("oa")),
                score(final.get("aa")),
                score(final.get("kappa")),
                summary.get("idle_share"),
                shares,
            ]
        )
    print("\nResults:")
    print(format_table(RESULT_COLUMNS, rows))
    print(legend(TABLE_LEGEND))
    print("\nEach worker's share and fitted model (round time = alpha + beta*b + transfer):")
    print(format_table(["mode", "slowdown", "share", *MODEL_COLUMNS], plans))
    print(legend(PLAN_LEGEND))
    print(
        "\nRun directories (metrics.jsonl, summary.json, the logs in cluster.log): "
        f"{args.out}/<mode>"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
