"""What-if grids: one cluster varied along named axes (workers, shards, link rate, ...)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from common.errors import ConfigError
from launch.simulate.engine import SIM_MODES, ModeResult, simulate
from launch.simulate.spec import GBIT, WIRE_BYTES, Cluster

AXES = ("workers", "shards", "gbit", "latency_ms", "global_batch", "wire_dtype", "mode")


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
                raise ConfigError(f"--sweep takes AXIS=V1,V2,... with AXIS in {AXES}, got {part!r}")
            if key in axes:
                raise ConfigError(f"--sweep names {key} twice")
            axes[key] = [_value(key, v) for v in values.split(",")]
    return axes


def _value(key: str, text: str) -> Any:
    if key == "wire_dtype":
        if text not in WIRE_BYTES:
            raise ConfigError(f"--sweep wire_dtype takes {list(WIRE_BYTES)}, got {text!r}")
        return text
    if key == "mode":
        if text not in SIM_MODES:
            raise ConfigError(f"--sweep mode takes {list(SIM_MODES)}, got {text!r}")
        return text
    try:
        number = float(text) if key in ("gbit", "latency_ms") else int(text)
    except ValueError:
        raise ConfigError(f"--sweep {key} takes numbers, got {text!r}") from None
    if number <= 0 and not (key == "latency_ms" and number == 0):
        raise ConfigError(f"--sweep {key} takes positive numbers, got {text!r}")
    return number


def vary(cluster: Cluster, point: dict[str, Any]) -> Cluster:
    """``cluster`` with the values of one grid point (``mode`` is not a cluster value).

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
    changes: dict[str, Any] = {"nodes": nodes}
    for key in ("shards", "global_batch", "wire_dtype"):
        if key in point:
            changes[key] = point[key]
    return dataclasses.replace(cluster, **changes)


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
