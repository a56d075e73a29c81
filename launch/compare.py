"""``pslaunch compare``: every mode on the same data, model, seeds and slowdowns, side by side.

Runs are interleaved (repeat 1 of every mode, then repeat 2, ...) so that a change in the
machine's load affects every mode alike. Each run gets the same seed and the same number of
samples, so only the mode differs. With ``launcher="slurm"`` each run is a Slurm job (see
``launch.slurm.submit``), submitted and waited for in the same order. The target accuracy is
read off the eval events afterwards (runs are not stopped at it), so one run gives both the
time to target and the final scores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import platform
import re
import shutil
import socket
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from common import rundir
from common.config import need
from common.data.dataset import DatasetReader
from common.errors import ConfigError, PSError
from common.safefile import write_atomic
from common.training.rounds import round_events, round_spread
from common.training.tables import oa_text
from launch.cluster.budgets import usable_cores
from launch.cluster.nodes import Nodes
from launch.cluster.spec import ClusterSpec, NodeSpec
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.local import LocalCluster, run_local, worker_name
from launch.procs import new_events
from launch.progress import RunProgress, eval_label
from launch.settings import TrainSettings, server_mode_args
from launch.slurm.config import LAUNCHERS, SlurmJob, SlurmRuns
from launch.slurm.submit import run_job
from pserver.config import MODES, STALENESS
from pserver.snapshots.snapshot_eval import SnapshotEvalConfig, evaluate_snapshots

log = logging.getLogger(__name__)

# What makes a directory hold a comparison (``--overwrite`` then replaces the whole directory).
COMPARISON_FILES = ("compare.json", "report.md", "report.png", "runs")
RESUME_FREE = {"setup", "resume", "overwrite"}  # settings a resumed comparison may change
SINGLE = "single"
WEIGHTED_DDP, DDP_KEPT = "weighted-ddp", "ddp-kept"
WEIGHTED_DDP_REBALANCE = "weighted-ddp-rebalance"
COMPARE_MODES = (*MODES, "ddp", WEIGHTED_DDP, WEIGHTED_DDP_REBALANCE, DDP_KEPT, SINGLE)
KEPT_SHARE = 0.05  # ddp-kept: the nodes that computed at least this share of weighted-sync's
MODES_HELP = (
    f"Comma-separated modes among {', '.join(COMPARE_MODES)}; '{SINGLE}' is the --workers 1 "
    "reference (one DDP process, slowdown 1, the whole global batch); weighted-ddp is pslaunch "
    "ddp --weighted, weighted-ddp-rebalance adds --rebalance epoch; ddp-kept is plain DDP on "
    "the nodes that computed >= 5 % of the samples of the same repeat's weighted-sync run (list "
    "weighted-sync before it)."
)


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """What ``pslaunch compare`` runs.

    Attributes:
        dataset, model: as for ``pserver start``.
        modes: modes to run, from ``COMPARE_MODES``.
        slowdowns: one slowdown factor per worker (and per DDP rank).
        out: the output directory (compare.json, report.md, report.png, runs/).
        train: the training settings every run shares (epochs or max_steps required).
        slowdown_schedules: per worker, ``STEP:F,...`` changes of its slowdown.
        devices: one device per worker, or one for all.
        repeats: runs per mode.
        target_oa: the test OA whose time to reach is reported (runs are not stopped there).
        staleness, max_staleness: async options (None: the server's default).
        server_options: further ``pserver start`` options for the parameter-server modes.
        worker_options: further ``worker join`` options for the parameter-server modes (e.g.
            ``--data COPY``: workers read a local copy, as DDP's ranks do).
        threads: torch CPU threads per worker and per DDP rank.
        launcher: ``local`` (processes on this machine) or ``slurm`` (one job per run).
        slurm: how runs become Slurm jobs (``launcher="slurm"`` only).
        snapshot_every: snapshot every N updates and take time to target from the snapshots
            (``score_snapshots``); None: from the per-epoch evaluations.
        nodes: the emulated cluster every run of every mode runs on (DDP rank i on worker
            i's node; ``single`` on the worker node with the largest CPU budget); None: all
            processes on this machine's loopback.
        allow_oversubscribe: run CPU budgets that sum to more cores than the machine has.
        overwrite: replace an earlier comparison in ``out`` (the whole directory); without
            it (or ``resume``) a directory holding a started run is refused.
        resume: finish the comparison in ``out`` (same settings): its recorded runs are kept,
            the others (missing, failed or interrupted) run again.
        ddp_checkpoint_every: DDP runs checkpoint every this many epochs.
        restarts: how often a local run's dead server or worker is started again
            (``launch.restarts``).
    """

    dataset: Path
    model: str
    modes: tuple[str, ...]
    slowdowns: tuple[float, ...]
    out: Path
    train: TrainSettings
    slowdown_schedules: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    repeats: int = 1
    target_oa: float | None = None
    staleness: str | None = None
    max_staleness: int | None = None
    server_options: tuple[str, ...] = ()
    worker_options: tuple[str, ...] = ()
    threads: int = 1
    launcher: str = "local"
    slurm: SlurmRuns = dataclasses.field(default_factory=SlurmRuns)
    snapshot_every: int | None = None
    nodes: ClusterSpec | None = None
    overwrite: bool = False
    allow_oversubscribe: bool = False
    resume: bool = False
    ddp_checkpoint_every: int = 1
    restarts: int = 3

    def validate(self) -> CompareConfig:
        """Check every field.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        self.train.validate()
        unknown = [m for m in self.modes if m not in COMPARE_MODES]
        if not self.modes or unknown:
            raise ConfigError(
                f"--modes {','.join(self.modes)!r}: give modes among {', '.join(COMPARE_MODES)}"
            )
        need(
            len(set(self.modes)) == len(self.modes),
            f"--modes {','.join(self.modes)!r} names a mode twice",
        )
        if DDP_KEPT in self.modes and (
            "weighted-sync" not in self.modes
            or self.modes.index("weighted-sync") > self.modes.index(DDP_KEPT)
        ):
            raise ConfigError(
                f"--modes {','.join(self.modes)!r}: ddp-kept runs DDP on the nodes the same "
                "repeat's weighted-sync run kept, so list weighted-sync before it"
            )
        if self.train.epochs is None and self.train.max_steps is None:
            raise ConfigError(
                "compare needs --epochs (or --max-steps): every run sees as many samples"
            )
        need(
            self.train.target_oa is None,
            "give the target as CompareConfig.target_oa; runs are not stopped at it",
        )
        need(self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}")
        if self.target_oa is not None and not 0 < self.target_oa <= 1:
            raise ConfigError(f"--target-oa must be in (0, 1], got {self.target_oa}")
        if self.staleness is not None and self.staleness not in STALENESS:
            raise ConfigError(
                f"--staleness {self.staleness!r} is not one of {', '.join(STALENESS)}"
            )
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ConfigError(f"--snapshot-every must be >= 1, got {self.snapshot_every}")
        self.cluster("weighted-sync", self.out).validate()
        self.ddp("ddp", self.out).validate()
        need(
            self.launcher in LAUNCHERS,
            f"--launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}",
        )
        if self.nodes is not None and self.launcher == "local":
            # fail once, before any run, without root, a cpu controller or enough cores
            Nodes(self.nodes, allow_oversubscribe=self.allow_oversubscribe).open()
        if self.launcher == "slurm":
            self._validate_slurm()
        need(not (self.resume and self.overwrite), "--resume and --overwrite exclude each other")
        held = [p.name for p in sorted(self.out.glob("runs/*")) if rundir.started(p)]
        if held and not (self.resume or self.overwrite):  # the run-folder rule, for them all
            raise ConfigError(
                f"--out {self.out} holds an earlier comparison (runs {', '.join(held)}); give "
                "--resume to finish it or --overwrite to replace it"
            )
        if self.resume and not (self.out / "compare.json").is_file():
            raise ConfigError(f"--resume: {self.out} holds no compare.json to finish")
        return self

    def _validate_slurm(self) -> None:
        """Refuse what Slurm runs do not support; build one job of each kind as a check."""
        if any(self.slowdown_schedules):
            raise ConfigError("--slowdown-schedules is not supported with --launcher slurm")
        if {WEIGHTED_DDP, WEIGHTED_DDP_REBALANCE, DDP_KEPT} & set(self.modes):
            raise ConfigError(
                "--launcher slurm runs plain ddp only: weighted-ddp, weighted-ddp-rebalance "
                "and ddp-kept need --launcher local"
            )
        if self.nodes is not None and self.nodes.links:
            raise ConfigError("--links emulates hosts on this machine: use --launcher local")
        if self.nodes is not None and self.nodes.budgets:
            raise ConfigError(
                "CPU budgets (--node-cpus, --server-cpus, --cluster) apply to processes on "
                "this machine: use --launcher local"
            )
        need(
            set(self.devices) == {"cpu"},
            f"--devices {','.join(self.devices)!r}: with --launcher slurm workers run on "
            "the CPUs Slurm gives them (use pslaunch slurm --gpus-per-worker for GPUs)",
        )
        self.slurm.validate()
        self.slurm_job("weighted-sync", self.out / "runs" / "check")
        self.slurm_job("ddp", self.out / "runs" / "check")

    def _server_mode_options(self, mode: str) -> list[str]:
        """``pserver start`` options for the snapshots and the async settings given.

        Snapshots are kept every ``snapshot_every`` updates, in async every that many times
        the workers pushes (one push applies about B / workers samples), so they are about
        equally many samples apart in every mode. With snapshots the server evaluates only at
        the end: the curve comes from the snapshots, and in-run evaluations would only take
        cores from the workers of the same machine.
        """
        options: list[str] = []
        if self.snapshot_every is not None:
            every = self.snapshot_every * (len(self.slowdowns) if mode == "async" else 1)
            options = ["--snapshot-every-updates", str(every), "--eval-every", "0"]
        return [*options, *server_mode_args(self.staleness, self.max_staleness)]

    def cluster(self, mode: str, run_dir: Path) -> LocalCluster:
        """The parameter-server run of ``mode``."""
        options = [*self.train.server_args(), *self._server_mode_options(mode)]
        return LocalCluster(
            dataset=self.dataset,
            model=self.model,
            mode=mode,
            slowdowns=self.slowdowns,
            run_dir=run_dir,
            server_options=(*options, *self.server_options),
            devices=self.devices,
            slowdown_schedules=self.slowdown_schedules,
            worker_options=("--threads", str(self.threads), *self.worker_options),
            nodes=self.nodes,
            allow_oversubscribe=self.allow_oversubscribe,
            restarts=self.restarts,
        )

    def ddp(self, mode: str, run_dir: Path, kept: Sequence[int] = ()) -> DDPConfig:
        """The DDP run (``ddp``, ``weighted-ddp``, or ``ddp-kept`` on the nodes ``kept``) or
        the single-process reference (``single``)."""
        config = DDPConfig(
            dataset=self.dataset,
            model=self.model,
            slowdowns=self.slowdowns,
            run_dir=run_dir,
            train=self.train,
            slowdown_schedules=self.slowdown_schedules,
            devices=self.devices,
            threads=self.threads,
            snapshot_every_steps=self.snapshot_every,
            nodes=self.nodes,
            allow_oversubscribe=self.allow_oversubscribe,
            weighted=mode in (WEIGHTED_DDP, WEIGHTED_DDP_REBALANCE),
            rebalance="epoch" if mode == WEIGHTED_DDP_REBALANCE else "none",
            checkpoint_every=self.ddp_checkpoint_every,
        )
        if mode == SINGLE:
            return dataclasses.replace(
                config,
                slowdowns=(1.0,),
                slowdown_schedules=(),
                devices=self.devices[:1],
                nodes=self._single_node(),
            )
        return config.subset(kept) if mode == DDP_KEPT else config

    def kept_nodes(self, summary: dict[str, Any]) -> list[int]:
        """The nodes of a weighted-sync run (its summary) that computed at least
        ``KEPT_SHARE`` of its samples, by index."""
        nodes = self.nodes.workers if self.nodes else [NodeSpec()] * len(self.slowdowns)
        index = {
            worker_name(i, s, n.cpus): i
            for i, (s, n) in enumerate(zip(self.slowdowns, nodes, strict=True))
        }
        samples = {index[w["name"]]: w["samples"] for w in summary["workers"] if w["name"] in index}
        total = sum(samples.values())
        return sorted(i for i, n in samples.items() if total and n >= KEPT_SHARE * total)

    def _single_node(self) -> ClusterSpec | None:
        """The reference run's one node: the worker node with the largest CPU budget."""
        if self.nodes is None:
            return None
        fastest = max(self.nodes.workers, key=lambda n: n.cpus or 0.0)
        return dataclasses.replace(self.nodes, workers=(fastest,))

    def slurm_job(self, mode: str, run_dir: Path) -> SlurmJob:
        """The run of ``mode`` as a Slurm job with the same settings as a local run."""
        server_mode = mode in MODES
        return self.slurm.job(
            dataset=self.dataset,
            model=self.model,
            mode=mode if server_mode else "ddp",
            run_dir=run_dir,
            slowdowns=self.slowdowns if mode != SINGLE else (1.0,),
            train=self.train,
            cpus=self.threads,
            server_options=(*self._server_mode_options(mode), *self.server_options),
            worker_options=self.worker_options,
        )

    def settings(self) -> dict[str, Any]:
        """The settings as JSON-ready data."""
        data = dataclasses.asdict(self)
        data["dataset"], data["out"] = str(self.dataset), str(self.out)
        data["setup"] = collect_setup()
        data["cluster"] = None if self.nodes is None else self.nodes.describe()
        return data


def collect_setup() -> dict[str, Any]:
    """The machine a comparison runs on.

    Returns:
        ``{"host", "cpu", "cpus", "gpus", "torch", "python", "os"}``: ``cpu`` the model name
        (``/proc/cpuinfo``, else ``platform.processor()``, else "unknown"), ``cpus`` the usable
        cores, ``gpus`` the CUDA device names (empty without CUDA).
    """
    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        cpuinfo = ""
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {
        "host": socket.gethostname(),
        "cpu": found.group(1).strip() if found else platform.processor() or "unknown",
        "cpus": usable_cores(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def initial_scores(
    dataset: Path, model: str, seed: int, batch: int = 512, progress: bool = False
) -> dict[str, float]:
    """Evaluate the model as the server and every DDP rank initialise it.

    They all call ``torch.manual_seed(seed)`` and then ``build_model``, so with the same seed
    every run of a comparison starts from these parameters.

    Args:
        dataset: the HDF5 dataset.
        model: a built-in model name or ``package.module:factory``.
        seed: the runs' seed.
        batch: evaluation batch size.
        progress: show a progress bar of the evaluation on stderr.

    Returns:
        ``{"oa", "aa", "kappa", "loss"}`` on the whole test split.

    Raises:
        DatasetError, ModelError: the dataset or the model cannot be loaded.
    """
    import torch  # only when a comparison starts

    from common.training.evaluator import Evaluator
    from common.training.flat import FlatLayout
    from common.training.models import build_model

    reader = DatasetReader(dataset)
    try:
        channels, height, _ = reader.meta.shape
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            net = build_model(model, channels, reader.meta.num_classes, height)
        state = FlatLayout(net).read_state().numpy()
        scores = Evaluator(net, reader, num_classes=reader.meta.num_classes, batch=batch).evaluate(
            state, progress=progress
        )
    finally:
        reader.close()
    return {"oa": scores.oa, "aa": scores.aa, "kappa": scores.kappa, "loss": scores.loss}


class RunStatus(RunProgress):
    """Shows one run's latest evaluation on the compare bar, from its ``metrics.jsonl`` events.

    Args:
        bar: the compare bar (one step per run).
        label: the run's name on its status line.
    """

    def __init__(self, bar: tqdm, label: str) -> None:
        super().__init__(None, None, enabled=False)
        self.compare_bar, self.label = bar, label
        self.show("starting")

    def show(self, text: str) -> None:
        """Put ``text`` on the compare bar's status line, after the run's name."""
        self.compare_bar.set_postfix_str(f"{self.label}: {text}", refresh=True)

    def feed(self, record: dict[str, Any]) -> None:
        super().feed(record)
        if record.get("event") == "eval" and self.oa is not None:
            self.show(f"{eval_label(record)} {oa_text(record)}")


def eval_curve(run_dir: Path) -> list[dict[str, float]]:
    """The run's evaluations as training time (s), samples seen and scores.

    Training time is ``train_t`` where the run records it (DDP: evaluation blocks training and
    is excluded), else the event time minus the ``train_start`` time (the server evaluates
    beside training).

    Args:
        run_dir: a run directory with ``metrics.jsonl``.

    Returns:
        One point per evaluated version, in order of samples seen; a version scored twice
        (in-run, then again as the final evaluation) keeps the later, final scores.
    """
    start, by_version = 0.0, {}
    for event in new_events(run_dir / "metrics.jsonl", 0):
        if event["event"] == "train_start":
            start = event["t"]
        elif event["event"] == "eval":
            time_s = event.get("train_t", event["t"] - start)
            by_version[event["version"]] = {
                "time_s": round(max(time_s, 0.0), 4),
                "samples": event["samples"],
                **{k: event[k] for k in ("oa", "aa", "kappa")},
                **({"subset": event["test_samples"]} if event.get("subset") else {}),
            }
    return sorted(by_version.values(), key=lambda p: (p["samples"], p["time_s"]))


def time_to_target(curve: list[dict[str, float]], target: float | None) -> float | None:
    """Training time of the first evaluation with OA >= ``target`` (None if never reached)."""
    if target is None:
        return None
    return next((p["time_s"] for p in curve if p["oa"] >= target), None)


def max_drop(curve: list[dict[str, Any]], epoch_samples: int) -> float | None:
    """The largest fall of a point's OA below the best OA so far, over the points after the
    first epoch (``samples >= epoch_samples``); the best so far counts every earlier point.

    Args:
        curve: points with ``samples`` and ``oa`` (an eval or snapshot curve).
        epoch_samples: samples in one epoch (the training split's size).

    Returns:
        The drop (>= 0), or None when no point comes after the first epoch.
    """
    best, drop = -math.inf, None
    for point in sorted(curve, key=lambda p: p["samples"]):
        best = max(best, point["oa"])
        if point["samples"] >= epoch_samples:
            drop = max(drop or 0.0, best - point["oa"])
    return drop


def drop_stats(runs: list[dict[str, Any]], modes: tuple[str, ...]) -> dict[str, Any]:
    """Per mode, the median and the largest ``max_drop`` over its runs (None without any)."""
    out: dict[str, Any] = {}
    for mode in modes:
        drops = [r["max_drop"] for r in runs if r["mode"] == mode and r.get("max_drop") is not None]
        out[mode] = {"median": statistics.median(drops), "max": max(drops)} if drops else None
    return out


def run_record(
    mode: str, repeat: int, run_dir: Path, summary: dict[str, Any], target: float | None
) -> dict[str, Any]:
    """One run's entry of compare.json: its summary, epoch time, time to target and curve.

    Args:
        mode: the run's mode (or variant name).
        repeat: the repeat number (from 1).
        run_dir: the run directory (its metrics.jsonl is read).
        summary: the run's summary.
        target: the target OA (None: no time to target).

    Returns:
        ``{"mode", "repeat", "run_dir", "epoch_time_s", "round_median_s", "tail_share",
        "time_to_target_s", "curve", "summary"}`` (``common.training.rounds.round_spread``).
    """
    curve = eval_curve(run_dir)
    epochs = summary.get("epochs") or 0
    return {
        "mode": mode,
        "repeat": repeat,
        "run_dir": str(run_dir),
        "epoch_time_s": summary["train_time_s"] / epochs if epochs else None,
        **round_spread([float(e["round_s"]) for e in round_events(run_dir)]),
        "time_to_target_s": time_to_target(curve, target),
        "curve": curve,
        "summary": summary,
    }


def score_snapshots(
    run_dir: Path,
    target: float | None,
    every: int | None,
    threads: int = 1,
    allow_model: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Score a finished run's snapshots; the fields they add to its compare.json entry.

    ``pserver evaluate-snapshots`` scores them on the whole test split, and the time to
    target becomes the training time at which the first version reaching the target was
    produced, instead of the time of the first per-epoch evaluation above it.

    Args:
        run_dir: the run directory (with ``snapshots/``).
        target: the target OA (None: no time to target).
        every: the compare's ``--snapshot-every`` (None: snapshots are off; nothing is done).
        threads: torch threads for the evaluation.
        allow_model: the user model the runs were given (``package.module:factory``), if any.

    Returns:
        ``{"time_to_target_source": "evaluations"}`` when snapshots are off or could not be
        scored (then also ``"snapshot_error"``); else ``"snapshots"`` with ``"time_to_target_s"``
        (training time of the first snapshot reaching the target, or None), ``"snapshot_every"``
        (updates) and ``"snapshot_curve"`` (one point per snapshot, in the curve format).
    """
    if every is None:
        return {"time_to_target_source": "evaluations"}
    config = SnapshotEvalConfig(
        run_dir, target_oa=target, threads=threads, progress=False, allow_model=allow_model
    )
    try:
        result = evaluate_snapshots(config)
    except PSError as exc:
        log.error("compare: snapshots of %s not scored: %s", run_dir.name, exc)
        return {"time_to_target_source": "evaluations", "snapshot_error": str(exc)}
    first = result["first"]
    curve = [
        {
            "time_s": row["train_time_s"],
            "samples": row["samples"],
            "version": row["version"],
            **{k: row[k] for k in ("oa", "aa", "kappa")},
        }
        for row in result["rows"]
    ]
    return {
        "time_to_target_source": "snapshots",
        "time_to_target_s": None if first is None else first["train_time_s"],
        "time_to_target_version": None if first is None else first["version"],
        "snapshot_every": result["every"],
        "snapshot_curve": curve,
    }


def run_compare(config: CompareConfig, show_progress: bool = True) -> dict[str, Any]:
    """Run every mode ``repeats`` times and write compare.json, report.md and report.png.

    A run that fails after it started is recorded with its error and the comparison goes on;
    a run that could not start, or Ctrl-C, stops it with a report of the runs that ended
    (``"stopped"`` in compare.json), and ``resume`` later runs the rest.

    Args:
        config: what to compare.
        show_progress: show a progress bar with the current run, epoch and OA on stderr.

    Returns:
        The content of ``compare.json``: ``{"settings", "initial", "runs", "max_drop",
        "report"}``; each run has its ``max_drop`` (``max_drop``, on the snapshot curve where
        there is one, else on the per-epoch evaluations), and ``max_drop`` maps each mode to
        ``{"median", "max"}`` over its runs.

    Raises:
        ConfigError: the configuration is invalid.
        PSError: a run could not start (every later run would fail the same way); the
            comparison stops, its report covering the runs that ended.
    """
    config.validate()
    data: dict[str, Any]
    if config.resume:
        data = _resumed(config)
    else:
        # nothing of an earlier comparison, finished or not, may stay
        if any((config.out / name).exists() for name in COMPARISON_FILES):
            log.info("compare: removing the earlier comparison in %s", config.out)
            shutil.rmtree(config.out)
        config.out.mkdir(parents=True, exist_ok=True)
        data = {"settings": config.settings(), "runs": [], "initial": None}
        try:  # the scores of the initial model all runs share: the curves' t = 0 point
            data["initial"] = initial_scores(
                config.dataset, config.model, config.train.seed, progress=show_progress
            )
        except PSError as exc:
            log.warning("compare: no t = 0 point: %s", exc)
    with DatasetReader(config.dataset, cache_bytes=0) as reader:
        epoch_samples = len(reader.train_indices)
    total = config.repeats * len(config.modes)
    done = {(r["mode"], r["repeat"]) for r in data["runs"]}
    with tqdm(
        total=total, initial=len(done), desc="compare", unit="run", disable=not show_progress
    ) as bar:
        try:
            for repeat in range(1, config.repeats + 1):
                for mode in (m for m in config.modes if (m, repeat) not in done):
                    kept = _kept(config, data["runs"], repeat) if mode == DDP_KEPT else None
                    data["runs"].append(_run_one(config, mode, repeat, bar, epoch_samples, kept))
                    bar.update(1)
                    _write_json(config.out / "compare.json", data)
        except (KeyboardInterrupt, PSError):  # Ctrl-C, or a run that could not start
            if data["runs"]:
                data["stopped"] = f"after {len(data['runs'])} of {total} runs"
                _report(data, config)
                log.warning(
                    "compare: stopped %s; report.md covers those; --resume runs the rest",
                    data["stopped"],
                )
            raise
    return _report(data, config)


def _report(data: dict[str, Any], config: CompareConfig) -> dict[str, Any]:
    """Write the report of the runs in ``data`` and compare.json; returns ``data``."""
    from launch.report import write_report  # matplotlib only when reporting

    data["max_drop"] = drop_stats(data["runs"], config.modes)
    data["report"] = write_report(data, config.out)
    _write_json(config.out / "compare.json", data)
    return data


def _kept(config: CompareConfig, runs: list[dict[str, Any]], repeat: int) -> list[int] | str:
    """The nodes this repeat's weighted-sync run kept, or why there are none."""
    run = next(r for r in runs if r["mode"] == "weighted-sync" and r["repeat"] == repeat)
    if "error" in run:
        return f"no nodes to keep: weighted-sync #{repeat} failed"
    return config.kept_nodes(run["summary"]) or f"weighted-sync #{repeat} kept no node"


def _resumed(config: CompareConfig) -> dict[str, Any]:
    """The comparison to finish: its compare.json with the runs that ended without an error;
    the folders of the others are removed.

    Raises:
        ConfigError: it was made with other settings.
    """
    data = json.loads((config.out / "compare.json").read_text(encoding="utf-8"))
    now = json.loads(json.dumps(config.settings()))
    old = data.get("settings") or {}
    differs = sorted(k for k in {*now, *old} - RESUME_FREE if now.get(k) != old.get(k))
    if differs:
        raise ConfigError(
            f"--resume: the comparison in {config.out} was made with other settings "
            f"({', '.join(differs)}); give the same options, or --overwrite to replace it"
        )
    data["runs"] = [r for r in data.get("runs", []) if "error" not in r]
    data.pop("stopped", None)
    kept = {Path(r["run_dir"]).name for r in data["runs"]}
    for folder in config.out.glob("runs/*"):
        if folder.name not in kept:
            shutil.rmtree(folder)
    return data


def _run_one(
    config: CompareConfig,
    mode: str,
    repeat: int,
    bar: tqdm,
    epoch_samples: int,
    kept: list[int] | str | None = None,
) -> dict[str, Any]:
    run_dir = config.out / "runs" / f"{mode}-{repeat}"
    label = f"{mode} #{repeat}/{config.repeats}"
    log.info("compare: %s in %s", label, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    status = RunStatus(bar, label)
    noted = {} if kept is None or isinstance(kept, str) else {"kept_nodes": kept}
    with (run_dir / "cluster.log").open("w", encoding="utf-8") as log_file:
        try:
            if isinstance(kept, str):
                raise PSError(kept)
            if config.launcher == "slurm":
                summary = _run_slurm(config, mode, run_dir, log_file, status)
            elif mode in MODES:
                summary = run_local(config.cluster(mode, run_dir), log_file, status)
            else:
                summary = run_ddp(config.ddp(mode, run_dir, kept or ()), log_file, status)
        except PSError as exc:
            if not rundir.started(run_dir):
                raise PSError(f"{label} could not start: {exc}") from exc
            log.error("compare: %s failed: %s", label, exc)
            failed = {"mode": mode, "repeat": repeat, "run_dir": str(run_dir), "error": str(exc)}
            return {**failed, **noted}
    every = config.snapshot_every if config.launcher == "local" or mode in MODES else None
    if every is not None:  # Slurm DDP jobs keep no snapshots: their per-epoch evaluations count
        status.show("scoring snapshots")
    user_model = (config.model,) if ":" in config.model else ()  # the model compare was given
    scored = score_snapshots(run_dir, config.target_oa, every, config.threads, user_model)
    record = {**run_record(mode, repeat, run_dir, summary, config.target_oa), **scored, **noted}
    curve = record.get("snapshot_curve") or record["curve"]
    return {**record, "max_drop": max_drop(curve, epoch_samples)}


def _run_slurm(
    config: CompareConfig, mode: str, run_dir: Path, log_file: IO[str], status: RunStatus
) -> dict[str, Any]:
    """Run ``mode`` as a Slurm job and return its summary (its logs stay in ``run_dir``)."""

    def submitted(job_id: str) -> None:
        log_file.write(f"compare: {mode} runs as Slurm job {job_id}; its logs are in {run_dir}\n")
        status.show(f"Slurm job {job_id}")

    job = config.slurm_job(mode, run_dir)
    command = f"pslaunch compare --launcher slurm ({mode}, {run_dir.name})"
    return run_job(job, command, config.slurm.wait_timeout_s, on_submit=submitted)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2) + "\n"
    write_atomic(path, lambda handle: handle.write(text.encode()))
