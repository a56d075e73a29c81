"""Simulation results as a text table, a JSON document and plots (epoch time against workers
and against shards)."""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.training.tables import format_table
from launch.simulate.engine import ModeResult
from launch.simulate.spec import MB, Cluster

Row = tuple[dict[str, Any], ModeResult]

LEGEND = (
    "round s: mean round (async: time to apply one global batch of samples); epoch s: one "
    "epoch (* extrapolated from fewer rounds); idle: share of member time waiting at the "
    "barrier; comm s: round time after the slowest member's compute; members: mean workers "
    "per round; worker MB / server MB: per round, the busiest worker host's and shard host's "
    "link, both directions (async: worker per push); ring s: a ring all-reduce of the model "
    "over the slowest link; comm/ring: comm s over ring s; tau: async staleness mean/max "
    "(refused pushes)."
)


DESCRIBED = ("model_params", "wire_dtype", "global_batch", "samples", "shards", "colocated",
             "max_staleness", "planner", "min_local_batch")  # fmt: skip


def describe(cluster: Cluster) -> dict[str, Any]:
    """The cluster in a few JSON-able numbers (node groups with counts)."""
    groups: collections.Counter[str] = collections.Counter(
        n.name.rsplit("#", 1)[0] for n in cluster.nodes
    )
    return {"nodes": dict(groups), **{key: getattr(cluster, key) for key in DESCRIBED}}


def table(rows: Sequence[Row]) -> str:
    """A fixed-width table, one line per (grid point, mode)."""
    axes = [k for k in (rows[0][0] if rows else {}) if k != "mode"]
    head = [*axes, "mode", "round s", "epoch s", "idle", "comm s", "members", "worker MB",
            "server MB", "ring s", "comm/ring", "tau"]  # fmt: skip
    lines = []
    for point, r in rows:
        tau = "-"
        if r.staleness is not None:
            tau = f"{r.staleness['mean']:.1f}/{r.staleness['max']} ({r.rejected})"
        lines.append(
            [
                *(str(point[a]) for a in axes),
                r.mode,
                f"{r.round_s:.4g}",
                f"{r.epoch_s:.4g}" + ("*" if r.extrapolated else ""),
                "-" if r.idle_share is None else f"{r.idle_share:.3f}",
                "-" if r.comm_s is None else f"{r.comm_s:.4g}",
                "-" if r.members is None else f"{r.members:.1f}",
                f"{r.worker_link_bytes / MB:.4g}",
                f"{r.server_link_bytes / MB:.4g}",
                f"{r.ring_s:.4g}",
                "-" if r.comm_s is None or r.ring_s <= 0 else f"{r.comm_s / r.ring_s:.2f}",
                tau,
            ]
        )
    return format_table(head, lines)


def document(
    cluster: Cluster, rows: Sequence[Row], source: str, notes: Sequence[str] = ()
) -> dict[str, Any]:
    """The JSON document ``simulate.json`` holds."""
    return {
        "source": source,
        "cluster": describe(cluster),
        "results": [{"point": point, **r.as_dict()} for point, r in rows],
        "notes": list(notes),
    }


def write(
    out: Path, cluster: Cluster, rows: Sequence[Row], source: str, notes: Sequence[str] = ()
) -> list[Path]:
    """Write ``simulate.json`` and, for sweeps over workers or shards, the plots.

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "simulate.json"]
    written[0].write_text(json.dumps(document(cluster, rows, source, notes), indent=1) + "\n")
    for axis, name in (("workers", "epoch_vs_workers.png"), ("shards", "epoch_vs_shards.png")):
        values = {point.get(axis) for point, _ in rows}
        if len(values - {None}) > 1:
            written.append(_plot(rows, axis, out / name))
    return written


def _plot(rows: Sequence[Row], axis: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for point, r in rows:
        if axis not in point and r.mode != "ddp":
            continue
        others = ", ".join(f"{k}={v}" for k, v in point.items() if k not in (axis, "mode"))
        label = r.mode + (f" ({others})" if others else "")
        lines[label].append((float(point.get(axis, 0)), r.epoch_s))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    span = [x for pts in lines.values() for x, _ in pts]
    for label, pts in sorted(lines.items()):
        pts.sort()
        if len(pts) == 1 and axis == "shards":  # DDP has no shards: a level line
            ax.hlines(pts[0][1], min(span), max(span), linestyles="dashed", label=label)
            continue
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N" if axis == "workers" else "parameter shards K")
    ax.set_ylabel("simulated epoch time (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
