"""What-if grids: one cluster varied along named axes (workers, shards, link rate, ...)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import click

from common.config import need
from common.errors import ConfigError
from launch.simulate.engine import SIM_MODES, ModeResult, simulate
from launch.simulate.spec import GBIT, MAX_NODES, MB, WIRE_BYTES, Cluster

AXES: dict[str, click.ParamType] = {  # an axis and the values it takes
    "workers": click.IntRange(min=1, max=MAX_NODES),
    "shards": click.IntRange(min=1, max=MAX_NODES),
    "gbit": click.FloatRange(min=0, min_open=True),
    "latency_ms": click.FloatRange(min=0),
    "global_batch": click.IntRange(min=1),
    "wire_dtype": click.Choice(list(WIRE_BYTES)),
    "mode": click.Choice(SIM_MODES),
}


def parse_sweep(items: Iterable[str]) -> dict[str, list[Any]]:
    """Parse ``workers=8,16,32 shards=1,2`` (one or more ``AXIS=V1,V2,...`` per item).

    Raises:
        ConfigError: an unknown axis, a repeated one, or a value of the wrong kind.
    """
    axes: dict[str, list[Any]] = {}
    for item in items:
        for part in item.split():
            key, sep, values = part.partition("=")
            key = key.replace("-", "_")
            if not sep or key not in AXES or not values:
                raise ConfigError(
                    f"--sweep takes AXIS=V1,V2,... with AXIS in {tuple(AXES)}, got {part!r}"
                )
            need(key not in axes, f"--sweep names {key} twice")
            try:
                axes[key] = [AXES[key].convert(v, None, None) for v in values.split(",")]
            except click.BadParameter as exc:
                raise ConfigError(f"--sweep {key}: {exc.message}") from None
    return axes


def vary(cluster: Cluster, point: dict[str, Any]) -> Cluster:
    """``cluster`` with the values of one grid point (``mode`` is not a cluster value; any
    other key names a ``Cluster`` field).

    Raises:
        ConfigError: the point makes an invalid cluster (e.g. more co-located shards than
            nodes).
    """
    if "workers" in point:
        cluster = cluster.with_workers(point["workers"])
    nodes = cluster.nodes
    if "gbit" in point:
        rate = point["gbit"] * GBIT
        nodes = tuple(dataclasses.replace(n, link_bytes_s=rate) for n in nodes)
        cluster = dataclasses.replace(cluster, server_link_bytes_s=rate)
    if "latency_ms" in point:
        latency = point["latency_ms"] / 1e3
        nodes = tuple(dataclasses.replace(n, latency_s=latency) for n in nodes)
        cluster = dataclasses.replace(cluster, server_latency_s=latency)
    same = ("workers", "gbit", "latency_ms", "mode")  # not fields, or applied above
    changes = {k: v for k, v in point.items() if k not in same}
    return dataclasses.replace(cluster, nodes=nodes, **changes)


def run_grid(
    cluster: Cluster,
    modes: Sequence[str],
    axes: dict[str, list[Any]],
    **simulate_args: Any,
) -> list[tuple[dict[str, Any], ModeResult]]:
    """Simulate every mode at every point of the grid (the product of ``axes``).

    Args:
        cluster: the base cluster.
        modes: modes to simulate (an axis ``mode`` replaces them).
        axes: axis -> values.
        **simulate_args: passed to ``simulate`` (epochs, max_rounds, seed, plan_spread).

    Returns:
        (grid point, result) pairs in grid order; DDP, which has no shards, is simulated once
        per point of the other axes.
    """
    keys = [k for k in axes if k != "mode"]
    results: list[tuple[dict[str, Any], ModeResult]] = []
    seen_ddp: set[tuple[Any, ...]] = set()
    for values in itertools.product(*(axes[k] for k in keys)):
        point = dict(zip(keys, values, strict=True))
        for mode in axes.get("mode", modes):
            if mode == "ddp":
                key = tuple(v for k, v in point.items() if k != "shards")
                if key in seen_ddp:
                    continue
                seen_ddp.add(key)
            varied = vary(cluster, point)
            results.append(({**point, "mode": mode}, simulate(varied, mode, **simulate_args)))
    return results


SIT_OUT = 0.01  # a group computing less than this share of the samples sits out
BINDS = 0.5  # the busiest shard link carrying data for more than this share of the round
SYNC = ("weighted-sync", "equal-sync")


def notes(
    cluster: Cluster, rows: Sequence[tuple[dict[str, Any], ModeResult]], **simulate_args: Any
) -> list[str]:
    """What the table does not show: each node group's members and share of the samples,
    groups that sit out and what DDP on the other groups would take, and a shard host's link
    that binds the round (more shards spread it).

    Args:
        cluster: the base cluster.
        rows: ``run_grid``'s result.
        **simulate_args: as for ``run_grid`` (the DDP comparisons run with them).

    Returns:
        One line per observation.
    """
    lines = []
    for point, result in rows:
        at = ", ".join(f"{k}={v}" for k, v in point.items() if k != "mode")
        name = result.mode + (f" ({at})" if at else "")
        parts = [
            f"{g} {_members(s)}{100 * s['share']:.1f} % of the samples"
            for g, s in result.groups.items()
        ]
        lines.append(f"{name}: " + "; ".join(parts))
        varied = vary(cluster, point)
        out = [g for g, s in result.groups.items() if s["share"] < SIT_OUT]
        rest = tuple(n for n in varied.nodes if n.name.rsplit("#", 1)[0] not in out)
        if out and rest and result.mode != "ddp":
            shards = min(varied.shards, len(rest)) if varied.colocated else varied.shards
            alone = simulate(
                dataclasses.replace(varied, nodes=rest, shards=shards), "ddp", **simulate_args
            )
            lines.append(
                f"  {', '.join(out)} sit{'s' if len(out) == 1 else ''} out; DDP on the other "
                f"nodes alone: {alone.epoch_s:.4g} s an epoch (this: {result.epoch_s:.4g} s)"
            )
        busy_s = result.server_link_bytes / varied.shard_link_bytes_s  # a pull, then a push
        busier = result.server_link_bytes > 1.5 * result.worker_link_bytes  # than any worker
        if result.mode in SYNC and busier and busy_s > BINDS * result.round_s:
            powers = ",".join(str(2**k) for k in range(int(math.log2(len(varied.nodes))) + 1))
            lines.append(
                f"  the busiest shard host's link binds: {result.server_link_bytes / MB:.4g} MB "
                f"a round take it {busy_s:.3g} s of {result.round_s:.3g} s; more shards spread "
                f"the traffic (--shards K; --sweep shards={powers} shows how many)"
            )
    return lines


def _members(group: dict[str, Any]) -> str:
    """``1.4 of 6 a round, `` (sync and DDP), or ``6 nodes, `` (async: no rounds)."""
    if group["members"] is None:
        return f"{group['nodes']} nodes, "
    return f"{group['members']:.1f} of {group['nodes']} a round, "
