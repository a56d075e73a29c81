"""Validate the simulator against runs measured on this machine: ``python -m
launch.simulate.validate --out DIR``.

Measures, back to back and interleaved over ``--repeats``, Jasper Ridge runs of weighted-sync,
equal-sync, async (``pslaunch local``) and DDP (``pslaunch ddp``) with the same slowdowns, after
three calibration runs: weighted-sync (each worker's compute model and time outside compute,
the server's step time, the spread of round times), DDP with the same slowdowns, and DDP with
equal slowdowns (its all-reduce time per step). Every prediction comes from calibration runs
only, never from the runs it is compared with (``PREDICTIONS`` says which), and is compared
with the median measured train time per epoch. Writes
``DIR/validate.json`` and prints the table (Markdown) that docs/scale.md keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common.data.convert.hsi import prepare_hsi
from launch.simulate.engine import simulate
from launch.simulate.fromrun import cluster_from_runs

log = logging.getLogger(__name__)
JASPER_DIR = Path(__file__).resolve().parents[3] / "shared/datasets/jasper_ridge"
RUN_TIMEOUT_S = 600.0
TOLERANCE = 0.15
MODES = ("weighted-sync", "equal-sync", "async", "ddp")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every measured run shares."""

    out: Path
    dataset: Path
    model: str
    slowdowns: str
    calibration_ddp_slowdowns: str
    epochs: int
    global_batch: int
    repeats: int


def _pslaunch(setup: Setup, mode: str, slowdowns: str, run_dir: Path) -> dict[str, Any]:
    """Run one configuration to the end and return its ``summary.json``."""
    command = "ddp" if mode == "ddp" else "local"
    args = [
        sys.executable, "-m", "launch.cli", command,
        "--dataset", str(setup.dataset), "--model", setup.model,
        "--slowdowns", slowdowns, "--epochs", str(setup.epochs),
        "--global-batch", str(setup.global_batch), "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip
    if mode != "ddp":
        args += ["--mode", mode]
    log.info("measuring %s slowdowns %s -> %s", mode, slowdowns, run_dir)
    subprocess.run(
        args, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL, env=dict(os.environ)
    )
    return json.loads((run_dir / "summary.json").read_text())


def measure(setup: Setup) -> dict[str, Any]:
    """The calibration runs, then every mode ``repeats`` times, interleaved.

    Returns:
        ``{"calibration": {name: DIR}, "runs": {mode: [DIR, ...]}}`` with calibration runs
        ``ps`` (weighted-sync), ``ddp`` (DDP, the same slowdowns) and ``ddp_equal`` (DDP with
        ``calibration_ddp_slowdowns``).
    """
    calibration = {
        "ps": ("weighted-sync", setup.slowdowns, setup.out / "calibration-weighted-sync"),
        "ddp": ("ddp", setup.slowdowns, setup.out / "calibration-ddp"),
        "ddp_equal": ("ddp", setup.calibration_ddp_slowdowns, setup.out / "calibration-ddp-equal"),
    }
    for mode, slowdowns, run_dir in calibration.values():
        _pslaunch(setup, mode, slowdowns, run_dir)
    runs: dict[str, list[str]] = {m: [] for m in MODES}
    for repeat in range(setup.repeats):
        for mode in MODES:
            run_dir = setup.out / f"{mode}-{repeat}"
            _pslaunch(setup, mode, setup.slowdowns, run_dir)
            runs[mode].append(str(run_dir))
    return {"calibration": {k: str(v[2]) for k, v in calibration.items()}, "runs": runs}


def _measured_epoch_s(run_dir: Path) -> float:
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["train_time_s"]) / max(int(summary["epochs"]), 1)


# (mode, calibration runs, what the prediction tests)
PREDICTIONS = (
    ("weighted-sync", ("ps",), "another run of the same configuration"),
    ("equal-sync", ("ps",), "another mode"),
    ("async", ("ps",), "another mode"),
    ("ddp", ("ddp",), "another run of the same configuration"),
    ("ddp", ("ps", "ddp_equal"), "PS compute, all-reduce at other slowdowns"),
)


def predict(setup: Setup, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per prediction: the epoch time predicted from calibration runs only, against
    the median (and range) measured over the repeats."""
    rows = []
    for mode, names, what in PREDICTIONS:
        sources = [Path(measured["calibration"][name]) for name in names]
        cluster = cluster_from_runs(sources)
        predicted = simulate(cluster, mode, epochs=setup.epochs).epoch_s
        times = [_measured_epoch_s(Path(d)) for d in measured["runs"][mode]]
        median = statistics.median(times)
        error = predicted / median - 1
        rows.append(
            {
                "mode": mode,
                "slowdowns": setup.slowdowns,
                "calibrated_on": [p.name for p in sources],
                "predicts": what,
                "predicted_epoch_s": round(predicted, 4),
                "measured_epoch_s": round(median, 4),
                "measured_min_s": round(min(times), 4),
                "measured_max_s": round(max(times), 4),
                "error": round(error, 4),
                "within_15pct": abs(error) <= TOLERANCE,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The validation table as docs/scale.md keeps it."""
    lines = [
        "| mode | slowdowns | calibrated on (predicts from) | predicted epoch s | measured epoch s "
        "(median; min-max) | error | within 15 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['slowdowns']} | "
            f"{' + '.join(r['calibrated_on'])} ({r['predicts']}) | "
            f"{r['predicted_epoch_s']:.3f} | {r['measured_epoch_s']:.3f} "
            f"({r['measured_min_s']:.3f}-{r['measured_max_s']:.3f}) | {100 * r['error']:+.1f} % | "
            f"{'yes' if r['within_15pct'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure (unless ``--reuse``), predict, write ``validate.json``, print the table."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("runs/simulate-validate"))
    parser.add_argument("--jasper-dir", type=Path, default=JASPER_DIR)
    parser.add_argument("--model", default="hsi-cnn")
    parser.add_argument("--slowdowns", default="1,2,4")
    parser.add_argument("--calibration-ddp-slowdowns", default="1,1,1")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--reuse", action="store_true", help="Predict from the runs a previous call measured."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "jasper_p5_tf10.h5"
    if not dataset.exists():
        prepare_hsi(
            str(args.jasper_dir / "JasperRidge.mat"),
            str(args.jasper_dir / "JasperRidge_gt.mat"),
            dataset,
            patch=5,
            train_fraction=0.1,
            split="random",
            seed=0,
        )
    setup = Setup(
        args.out, dataset, args.model, args.slowdowns, args.calibration_ddp_slowdowns,
        args.epochs, args.global_batch, args.repeats,
    )  # fmt: skip
    runs_file = args.out / "measured.json"
    if args.reuse:
        measured = json.loads(runs_file.read_text())
    else:
        measured = measure(setup)
        runs_file.write_text(json.dumps(measured, indent=1) + "\n")
    rows = predict(setup, measured)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "command": "python -m launch.simulate.validate " + " ".join(argv or sys.argv[1:]),
        "setup": {k: str(v) for k, v in dataclasses.asdict(setup).items()},
        "rows": rows,
    }
    (args.out / "validate.json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
