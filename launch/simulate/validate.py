"""Validate the simulator against runs measured on this machine: ``python -m
launch.simulate.validate --out DIR``.

Measures Jasper Ridge runs of weighted-sync, equal-sync, async (``pslaunch local``, evaluating
only at the end) and DDP (``pslaunch ddp``) with the same slowdowns, and calibration runs next
to them in time: weighted-sync (each worker's compute model and time outside compute, the
server's step time, the spread of round times), async (push times, the server's time per
push), DDP with the same slowdowns, and DDP with equal slowdowns (its all-reduce time per
step); back to back in ``ORDER``, each measured run between calibration runs of its kind,
``--repeats`` times. Every prediction comes from calibration runs only, never from the run it
is compared with (``PREDICTIONS`` says which), is the mean of the predictions from the runs
before and after it, and is compared with the measured train time per epoch of the run
between them; the table gives every repeat and the median error. With ``--node-cpus`` (and
``--server-cpus``) every run is on the emulated cluster, each node in its own CPU budget.
``--multihost`` also compares the multi-host bench's figures (kept here, or another kept
record, ``--multihost-results``) with the simulator, with CPU stage costs measured now. Writes
``DIR/validate.json`` and prints the tables (Markdown) that docs/scale.md keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common.data import JASPER_DIR
from common.data.convert.hsi import prepare_hsi
from launch.simulate.engine import simulate
from launch.simulate.fromrun import cluster_from_runs
from launch.simulate.spec import Cluster, Node, load_spec
from launch.simulate.stagecosts import measure_stage_costs

log = logging.getLogger(__name__)
MULTIHOST_SPEC = Path(__file__).resolve().parents[2] / "docs/clusters/multihost3.yaml"
# The multi-host bench's figures this validation compares with by default: the equal-sync run
# kept by `python -m bench multihost --workers 3 --rate 1gbit --mode equal-sync` (every process
# on this machine's 2 cores, nothing else running).
MULTIHOST_KEPT = (
    Path(__file__).resolve().parents[2] / "bench/results/multihost-1gbit-equal-sync.json"
)
# layout -> (mode, shards, co-located, wire dtype)
MULTIHOST_LAYOUTS = {
    "ddp": ("ddp", 1, False, "fp32"),
    "ps-k1": ("equal-sync", 1, False, "fp32"),
    "ps-k1-bf16": ("equal-sync", 1, False, "bf16"),
    "ps-kN": ("equal-sync", 3, True, "fp32"),
    "ps-kN-bf16": ("equal-sync", 3, True, "bf16"),
}
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
    modes: tuple[str, ...] = MODES
    node_cpus: str = ""
    server_cpus: str = ""

    def budget_args(self, equal: bool = False) -> list[str]:
        """``pslaunch``'s budget options (none without budgets); ``equal`` gives every node
        the largest budget (the DDP calibration that measures the all-reduce of equal ranks).
        """
        args = []
        if self.node_cpus:
            cpus = max(self.node_cpus.split(","), key=float) if equal else self.node_cpus
            args += ["--node-cpus", cpus]
        if self.server_cpus:
            args += ["--server-cpus", self.server_cpus]
        return args

    def predictions(self) -> list[tuple[str, tuple[str, ...], str]]:
        """The rows of ``PREDICTIONS`` for the modes measured."""
        return [row for row in PREDICTIONS if row[0] in self.modes]

    def order(self) -> list[tuple[str, str]]:
        """``ORDER`` without the runs these predictions do not need."""
        needed = {name for _, names, _ in self.predictions() for name in names}
        return [
            (kind, name)
            for kind, name in ORDER
            if (name in needed if kind == "cal" else name in self.modes)
        ]


def _pslaunch(
    setup: Setup, mode: str, slowdowns: str, run_dir: Path, equal: bool = False
) -> dict[str, Any]:
    """Run one configuration to the end and return its ``summary.json`` (``equal``: every
    node gets the largest budget)."""
    command = "ddp" if mode == "ddp" else "local"
    args = [
        sys.executable, "-m", "launch.cli", command,
        "--dataset", str(setup.dataset), "--model", setup.model,
        "--slowdowns", slowdowns, "--epochs", str(setup.epochs),
        "--global-batch", str(setup.global_batch), "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip
    args += setup.budget_args(equal)
    if mode != "ddp":  # evaluations only at the end: here they would take a core from training
        args += ["--mode", mode, "--server-opt=--eval-every=0"]
    log.info("measuring %s slowdowns %s -> %s", mode, slowdowns, run_dir)
    subprocess.run(
        args, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL, env=dict(os.environ)
    )
    return json.loads((run_dir / "summary.json").read_text())


# Per repeat, back to back: each measured run between calibration runs of its kind, before
# and after it (ddp_equal before only), so that a drift of the machine's load that goes one
# way over the minutes in between cancels in the mean of the two predictions.
ORDER = (
    ("cal", "ps"), ("run", "weighted-sync"), ("run", "equal-sync"), ("cal", "ps"),
    ("cal", "async"), ("run", "async"), ("cal", "async"),
    ("cal", "ddp_equal"), ("cal", "ddp"), ("run", "ddp"), ("cal", "ddp"),
)  # fmt: skip


def measure(setup: Setup) -> dict[str, Any]:
    """Per repeat: the calibration runs and every mode in ``ORDER`` (this machine's load
    drifts within minutes: a calibration run is only compared with runs next to it in time).

    Returns:
        ``{"repeats": [{"calibration": {name: [DIR, ...]}, "runs": {mode: DIR}}, ...]}`` with
        calibration runs ``ps`` (weighted-sync), ``async``, ``ddp`` (DDP, the same slowdowns)
        and ``ddp_equal`` (DDP with ``calibration_ddp_slowdowns``), in the order they ran.
    """
    repeats = []
    for repeat in range(setup.repeats):
        calibration = {
            "ps": ("weighted-sync", setup.slowdowns, "calibration-weighted-sync"),
            "async": ("async", setup.slowdowns, "calibration-async"),
            "ddp": ("ddp", setup.slowdowns, "calibration-ddp"),
            "ddp_equal": ("ddp", setup.calibration_ddp_slowdowns, "calibration-ddp-equal"),
        }
        done: dict[str, dict[str, Any]] = {"calibration": {}, "runs": {}}
        for kind, name in setup.order():
            if kind == "cal":
                mode, slowdowns, folder = calibration[name]
                dirs = done["calibration"].setdefault(name, [])
                run_dir = setup.out / f"{folder}-{repeat}{'-after' if dirs else ''}"
                _pslaunch(setup, mode, slowdowns, run_dir, equal=name == "ddp_equal")
                dirs.append(str(run_dir))
            else:
                run_dir = setup.out / f"{name}-{repeat}"
                _pslaunch(setup, name, setup.slowdowns, run_dir)
                done["runs"][name] = str(run_dir)
        repeats.append(done)
    return {"repeats": repeats}


# (mode, calibration runs, what the prediction tests)
PREDICTIONS = (
    ("weighted-sync", ("ps",), "another run of the same configuration"),
    ("equal-sync", ("ps",), "another mode"),
    ("async", ("async",), "another run of the same configuration"),
    ("async", ("ps",), "another mode"),
    ("ddp", ("ddp",), "another run of the same configuration"),
    ("ddp", ("ps", "ddp_equal"), "PS compute, all-reduce at other slowdowns"),
)


def _as_list(dirs: str | list[str]) -> list[str]:
    return [dirs] if isinstance(dirs, str) else dirs


def predict(setup: Setup, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per prediction: in every repeat, the epoch time predicted from that repeat's
    calibration runs (the mean of the predictions from the runs before and after, where
    there are both) against the run measured between them; the error is the median over
    repeats."""
    rows = []
    for mode, names, what in setup.predictions():
        pairs = []
        for repeat in measured["repeats"]:
            dirs = [_as_list(repeat["calibration"][name]) for name in names]
            predictions = [
                simulate(
                    cluster_from_runs([Path(d[min(i, len(d) - 1)]) for d in dirs]),
                    mode,
                    epochs=setup.epochs,
                ).epoch_s
                for i in range(max(len(d) for d in dirs))
            ]
            predicted = statistics.fmean(predictions)
            summary = json.loads((Path(repeat["runs"][mode]) / "summary.json").read_text())
            pairs.append((predicted, summary["train_time_s"] / max(summary["epochs"], 1)))
        errors = [p / m - 1 for p, m in pairs]
        error = float(statistics.median(errors))
        rows.append(
            {
                "mode": mode,
                "slowdowns": setup.slowdowns,
                "calibrated_on": [name for name in names],
                "predicts": what,
                "predicted_epoch_s": [round(p, 4) for p, _ in pairs],
                "measured_epoch_s": [round(m, 4) for _, m in pairs],
                "errors": [round(e, 4) for e in errors],
                "error": round(error, 4),
                "within_15pct": bool(abs(error) <= TOLERANCE),
            }
        )
    return rows


def _markdown(head: str, lines: list[str]) -> str:
    """A Markdown table of six columns: the header, the rule and ``lines``."""
    return "\n".join([head, "|---|---|---|---|---|---|", *lines])


def markdown(rows: list[dict[str, Any]]) -> str:
    """The validation table as docs/scale.md keeps it."""
    lines = []
    for r in rows:
        pairs = ", ".join(
            f"{p:.3f} / {m:.3f}"
            for p, m in zip(r["predicted_epoch_s"], r["measured_epoch_s"], strict=True)
        )
        errors = ", ".join(f"{100 * e:+.1f} %" for e in r["errors"])
        lines.append(
            f"| {r['mode']} | {' + '.join(r['calibrated_on'])} ({r['predicts']}) | {pairs} | "
            f"{errors} | {100 * r['error']:+.1f} % | {'yes' if r['within_15pct'] else 'no'} |"
        )
    head = "| mode | calibrated on (what the prediction tests) | predicted / measured epoch s, "
    return _markdown(head + "per repeat | error per repeat | median error | within 15 % |", lines)


def kept_figures(kept: Path = MULTIHOST_KEPT) -> dict[str, Any]:
    """The figures of a kept multi-host bench record (``bench/results/NAME.json``, or the file
    ``python -m bench --out FILE multihost ...`` wrote) for the layouts the simulator knows:
    communication = round time after the slowest worker's compute (DDP: the all-reduce
    alone), and each layout's slowest worker's compute per round (layouts the run did not
    have are left out).

    Raises:
        ValueError: the record holds no all-reduce reference (gloo failed in that run).
    """
    record = json.loads(kept.read_text(encoding="utf-8"))
    got = record["figures"]
    if "allreduce_s" not in got:
        raise ValueError(f"{kept} holds no all-reduce reference")
    comm = {"ddp": got["allreduce_s"]}
    comm |= {k: got[f"comm_s_{k}"] for k in MULTIHOST_LAYOUTS if f"comm_s_{k}" in got}
    compute = {k: got[f"compute_s_{k}"] for k in MULTIHOST_LAYOUTS if f"compute_s_{k}" in got}
    return {
        "source": f"{kept.name}: {record['date']}, {record['command']}",
        "compute_s": got["compute_s"],
        "communication_s": comm,
        "layout_compute_s": compute,
    }


def multihost(
    spec: Path = MULTIHOST_SPEC, repeats: int = 5, measured: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The multi-host bench's layouts simulated twice, on the links alone and with the CPU
    stages (rates measured now by ``measure_stage_costs`` for the bench's model, 3 shards and
    3 members, every process on the machine's cores), against the bench's figures.

    Args:
        spec: the bench's cluster as a simulator spec file.
        repeats: measurements per stage cost (the fastest counts).
        measured: the bench's figures (``kept_figures``); default ``kept_figures()``.

    Returns:
        ``{"measured": the figures, "stage_costs": {wire: rates in ms per MB},
        "load": load average at the measurement, "rows": [...]}``.
    """
    measured = measured or kept_figures()
    base = load_spec(spec)
    cores = os.cpu_count() or 1
    load = os.getloadavg()
    costs = {
        wire: measure_stage_costs(base.model_params, 3, len(base.nodes), wire, repeats)
        for wire in ("fp32", "bf16")
    }
    communication = measured["communication_s"]
    layout_compute = measured.get("layout_compute_s", {})
    rows = []
    for layout, (mode, shards, colocated, wire) in MULTIHOST_LAYOUTS.items():
        if layout not in communication:
            continue
        plain = dataclasses.replace(
            base,
            nodes=_computing(base, layout_compute.get(layout)),
            shards=shards,
            colocated=colocated,
            wire_dtype=wire,
        )
        with_cpu = dataclasses.replace(plain, server=costs[wire], shared_cores=float(cores))
        if mode == "ddp":  # the stages are the parameter server's; gloo's are in its figure
            with_cpu = plain
        predicted = {}
        for name, cluster in (("links", plain), ("links_cpu", with_cpu)):
            comm = simulate(cluster, mode, max_rounds=5).comm_s
            assert comm is not None  # every mode of MULTIHOST_LAYOUTS communicates
            predicted[name] = comm
        rows.append(
            {
                "layout": layout,
                "measured_s": communication[layout],
                **{f"{k}_s": round(v, 4) for k, v in predicted.items()},
                **{
                    f"{k}_error": round(v / communication[layout] - 1, 4)
                    for k, v in predicted.items()
                },
            }
        )
    return {
        "measured": measured,
        "stage_costs": {
            wire: {
                k: round(v * 1e3 * 1e6, 4)
                for k, v in dataclasses.asdict(rates).items()
                if k.endswith("_per_byte")
            }
            for wire, rates in costs.items()
        },
        "load": [round(x, 2) for x in load],
        "rows": rows,
    }


def _computing(cluster: Cluster, compute_s: float | None) -> tuple[Node, ...]:
    """The cluster's nodes, each computing ``compute_s`` per equal-sync step (the bench's
    slowest worker per round), so that pushes overlap backward as in the run; None keeps the
    spec's compute."""
    if compute_s is None:
        return cluster.nodes
    per_worker = cluster.global_batch / len(cluster.nodes)
    return tuple(
        dataclasses.replace(node, alpha_s=0.0, beta_s=compute_s / per_worker)
        for node in cluster.nodes
    )


def multihost_markdown(result: dict[str, Any]) -> str:
    """The multi-host table as docs/scale.md keeps it."""
    lines = [
        f"| {r['layout']} | {r['measured_s']:.3f} | {r['links_s']:.3f} | "
        f"{100 * r['links_error']:+.1f} % | {r['links_cpu_s']:.3f} | "
        f"{100 * r['links_cpu_error']:+.1f} % |"
        for r in result["rows"]
    ]
    head = "| layout | communication measured (s) | links only (s) | error | links + CPU stages (s)"
    return _markdown(head + " | error |", lines)


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
    parser.add_argument(
        "--node-cpus",
        default="",
        help="CPU budget per worker (or DDP rank), as pslaunch takes it (root); the equal-"
        "speed DDP calibration gives every rank the largest.",
    )
    parser.add_argument("--server-cpus", default="", help="The server's CPU budget (root).")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="Modes to measure and predict (with the calibration runs they need).",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="Predict from the runs a previous call measured."
    )
    parser.add_argument(
        "--multihost",
        action="store_true",
        help="Also compare the multi-host bench's figures with the simulator, with CPU stage "
        "costs measured now.",
    )
    parser.add_argument(
        "--multihost-results",
        type=Path,
        default=MULTIHOST_KEPT,
        help="The kept record of a `python -m bench multihost` run to compare with (`python -m "
        "bench --out FILE multihost ...` writes one).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not set(modes) <= set(MODES):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    if not modes and not args.multihost:
        parser.error("nothing to validate: give --modes or --multihost")
    dataset = args.out / "jasper_p5_tf10.h5"
    if modes and not dataset.exists():
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
        args.epochs, args.global_batch, args.repeats, modes, args.node_cpus, args.server_cpus,
    )  # fmt: skip
    runs_file = args.out / "measured.json"
    rows: list[dict[str, Any]] = []
    if modes:
        if args.reuse:
            measured = json.loads(runs_file.read_text())
        else:
            measured = measure(setup)
            runs_file.write_text(json.dumps(measured, indent=1) + "\n")
        rows = predict(setup, measured)
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "command": "python -m launch.simulate.validate " + shlex.join(argv or sys.argv[1:]),
        "setup": {k: str(v) for k, v in dataclasses.asdict(setup).items()},
        "rows": rows,
    }
    if args.multihost:
        result["multihost"] = multihost(measured=kept_figures(args.multihost_results))
    (args.out / "validate.json").write_text(json.dumps(result, indent=1) + "\n")
    if rows:
        print(markdown(rows))
    if args.multihost:
        print()
        print(multihost_markdown(result["multihost"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
