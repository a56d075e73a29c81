"""A simulated cluster fitted from real runs: each worker's model, the server's costs and the
spread of round times from a synchronous parameter-server run (from an async run: each
worker's push time and the server's time per push), the all-reduce time from a DDP run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.config import need
from common.errors import ConfigError
from common.regular_files import open_regular
from common.training.perfmodel import RoundSpread, robust_line
from common.training.rounds import WorkerRound, breakdown
from launch.simulate.spec import Cluster, Node, ServerCosts

MAX_RUN_BYTES = 4 << 30  # a run's metrics.jsonl read at most

# An async push waits for nobody, but a member of a sync round has its time outside compute
# stretched by the round's turnaround (the step, every member's reply and pull at once): the
# rounds in which a worker was served first, a low quantile of that time, show what its pull
# and push cost on their own.
PUSH_QUANTILE = 0.1
# An async server applies one push at a time, so two updates are never closer than its time
# per push; in a busy stretch they follow each other at that time. This quantile of the gaps
# between consecutive updates is taken as the server's time per push.
SERVICE_QUANTILE = 0.1


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a run directory holds that the simulator reads."""

    path: Path
    start: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: dict[str, Any]
    pushes: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def mode(self) -> str:
        """The run's mode (``ddp`` for the DDP baseline)."""
        return str(self.start.get("mode", ""))


def read_run(path: Path) -> RunFiles:
    """Read the last ``start`` event, the ``round`` events and ``summary.json`` of a run.

    Raises:
        ConfigError: the directory lacks ``metrics.jsonl`` or ``summary.json``, or they do not
            parse.
    """
    try:  # regular files only: a FIFO at either name would block the read for good
        with open_regular(path / "metrics.jsonl", MAX_RUN_BYTES) as metrics:
            lines = metrics.read().splitlines()
        with open_regular(path / "summary.json", MAX_RUN_BYTES) as handle:
            summary = json.loads(handle.read())
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a finished run directory: {exc}") from exc
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    need(starts, f"{path}/metrics.jsonl has no start event")
    records = records[starts[-1] :]
    rounds = [r for r in records if r.get("event") == "round"]
    pushes = [r for r in records if r.get("event") == "push"]
    return RunFiles(path, records[0], rounds, summary, pushes)


def _global_batch(run: RunFiles) -> int:
    if run.summary.get("global_batch"):
        return int(run.summary["global_batch"])
    totals = [sum(int(w.get("batch", 0)) for w in r.get("workers", [])) for r in run.rounds]
    return max(totals, default=0)


def _worker_node(name: str, parts: list[WorkerRound], sigma: float) -> Node | None:
    """A worker's node from its parts of the rounds: compute ``alpha + beta * b`` by the robust
    line through (batch, compute_s), shifted so its mean residual is 0, and its mean time
    outside compute (an epoch is a sum of rounds: means, not medians, add up to it) and, for
    async pushes, the ``PUSH_QUANTILE`` of that time (see there)."""
    points = [(p.batch, p.compute_s) for p in parts if p.batch]
    line = robust_line(points)
    if line is None:
        if not points:
            return None
        line = (0.0, math.fsum(t for _, t in points) / sum(b for b, _ in points))
    alpha, beta = line
    shift = statistics.fmean(t - alpha - beta * b for b, t in points)
    outside = [p.transfer_s or 0.0 for p in parts]
    return Node(
        name=name,
        alpha_s=max(alpha + shift, 0.0),
        beta_s=beta,
        transfer_s=statistics.fmean(outside),
        jitter_s=sigma,
        push_s=float(np.quantile(outside, PUSH_QUANTILE)),
    )


def _round_nodes(rounds: list[dict[str, Any]], sigma: float) -> list[Node]:
    """One node per worker of the round events, as ``breakdown`` reads them (DDP: each rank's
    emulated compute), from the rounds that timed the worker, sorted by name."""
    by_worker: dict[str, list[WorkerRound]] = {}
    for record in rounds:
        for part in breakdown(record):
            if not part.compute_estimated:
                by_worker.setdefault(part.worker, []).append(part)
    nodes = [
        node
        for name, parts in by_worker.items()
        if (node := _worker_node(name, parts, sigma)) is not None
    ]
    return sorted(nodes, key=lambda n: n.name)


def ps_nodes(run: RunFiles) -> tuple[list[Node], float]:
    """Nodes calibrated on every round of a parameter-server run (each worker's compute model
    and its time outside compute, measured rather than modelled), and the spread of round
    times (the robust sigma ``RoundSpread`` measures over the run).

    Raises:
        ConfigError: no round event times a worker's compute.
    """
    spread = RoundSpread(horizon=max(len(run.rounds), 1))
    for record in run.rounds:
        parts = [w for w in record.get("workers", []) if "predicted_s" in w and "actual_s" in w]
        spread.add_round([w["actual_s"] for w in parts], [w["predicted_s"] for w in parts])
    sigma = spread.sigma_s()
    nodes = _round_nodes(run.rounds, sigma)
    need(nodes, f"{run.path}: no round event times a worker's compute")
    return nodes, sigma


def async_nodes(run: RunFiles) -> tuple[list[Node], float]:
    """Nodes calibrated on an async run's ``push`` events, and the server's time per push.

    Each worker's compute is its fitted model in ``summary.json``; the time between two of its
    consecutive updates is compute, its pull and push, and the server's time for the push
    (waiting behind others' included): its mean minus the fitted compute and the server's time
    per push is the node's ``push_s`` (means: an epoch is a sum of pushes). The server's time
    per push is the ``SERVICE_QUANTILE`` of the gaps between consecutive updates.

    Raises:
        ConfigError: fewer than two pushes, or no worker with a fitted model and two pushes.
    """
    times = [float(p["t"]) for p in run.pushes]
    need(len(times) >= 2, f"{run.path}: fewer than two async pushes to measure")
    service = max(float(np.quantile(np.diff(times), SERVICE_QUANTILE)), 0.0)
    fits = {
        str(w["name"]): w["model"]
        for w in run.summary.get("workers", [])
        if isinstance(w.get("model"), dict)
    }
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for push in run.pushes:
        by_worker.setdefault(str(push["worker"]), []).append(push)
    nodes = []
    for name, pushes in sorted(by_worker.items()):
        model = fits.get(name)
        if model is None or len(pushes) < 2:
            continue
        alpha, beta = float(model["alpha_s"]), float(model["beta_s_per_sample"])
        outside = statistics.fmean(
            float(b["t"]) - float(a["t"]) - (alpha + beta * int(b["batch"]))
            for a, b in itertools.pairwise(pushes)
        )
        push_s = max(outside - service, 0.0)
        nodes.append(Node(name, alpha, beta, transfer_s=push_s, push_s=push_s))
    need(nodes, f"{run.path}: no worker has a fitted model and two pushes")
    return nodes, service


def ddp_nodes(run: RunFiles) -> tuple[list[Node], float]:
    """Nodes calibrated on a DDP run's per-rank compute times (slowdown included), and its
    mean all-reduce time per step (the step time minus the slowest rank's compute).

    Raises:
        ConfigError: the run recorded no steps.
    """
    need(run.rounds, f"{run.path}: no DDP steps to measure")
    overhead = [
        float(record["round_s"]) - max((p.compute_s for p in breakdown(record)), default=0.0)
        for record in run.rounds
    ]
    nodes = [dataclasses.replace(node, transfer_s=None) for node in _round_nodes(run.rounds, 0.0)]
    return nodes, max(statistics.fmean(overhead), 0.0)


def cluster_from_runs(paths: Sequence[Path]) -> Cluster:
    """A cluster calibrated on run directories: the nodes, server costs and spread of the
    first parameter-server run; the all-reduce time of the first DDP run (its nodes too when
    no parameter-server run is given).

    Args:
        paths: run directories (``pslaunch local`` or ``pslaunch ddp``).

    Returns:
        The cluster, with the run's model size, training samples, global batch, shards and
        wire dtype.

    Raises:
        ConfigError: no usable run, or a run directory cannot be read.
    """
    runs = [read_run(p) for p in paths]
    ps = next((r for r in runs if r.mode != "ddp"), None)
    ddp = next((r for r in runs if r.mode == "ddp"), None)
    base = ps or ddp
    if base is None:
        raise ConfigError("--from needs at least one run directory")
    allreduce = None
    if ps is not None and ps.pushes and not ps.rounds:
        nodes, step = async_nodes(ps)
    elif ps is not None:
        nodes, _ = ps_nodes(ps)
        steps = [float(r["step_s"]) for r in ps.rounds if "step_s" in r]
        step = statistics.fmean(steps) if steps else 0.0
    else:
        step = 0.0
    if ddp is not None:
        ddp_fitted, allreduce = ddp_nodes(ddp)
        if ps is None:
            nodes = ddp_fitted
    plan = base.start.get("plan") or {}
    return Cluster(
        nodes=tuple(nodes),
        model_params=int(base.start["state_size"]),
        global_batch=_global_batch(base) or 64,
        samples=int(base.start["train"]),
        wire_dtype=str(base.start.get("wire_dtype", "fp32")),
        shards=int(base.start.get("shards", 1)),
        colocated=False,
        server=ServerCosts(step_s=step),
        ddp_allreduce_s=allreduce,
        planner=str(plan.get("planner", "model")),
        min_local_batch=int(plan.get("min_batch") or 1),
    )
