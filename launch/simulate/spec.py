"""The simulated cluster: nodes, links, shards and server costs, read from a YAML or JSON spec.

A spec lists groups of nodes with a count each and their cost model (a step takes
``fixed_ms + per_sample_ms * b`` of compute), optionally drawn from a lognormal distribution
of speeds, and the links, model, batch and server costs they share::

    model_params: 11.7e6          # or model_mb (fp32 megabytes)
    global_batch: 1024
    samples: 100000               # training samples per epoch
    wire_dtype: fp32              # fp32 | bf16 | fp16
    shards: 4
    colocated: true               # shards on worker hosts (false: on dedicated server hosts)
    link: {gbit: 10, latency_ms: 0.05}
    server: {gbit: 10, step_ms: 1.0, step_ms_per_mb: 0.3, decode_ms_per_mb: 0.2}
    # further CPU rates (ms per MB, see ServerCosts): sum_, encode_, worker_decode_,
    # worker_encode_ms_per_mb; shared_cores: N when every host shares one machine's N cores
    groups:
      - {name: A100, count: 8, per_sample_ms: 0.9, fixed_ms: 4}
      - {name: T4, count: 24, per_sample_ms: 6.0, fixed_ms: 8, lognormal_sigma: 0.1}
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from common.config import need
from common.errors import ConfigError
from common.regular_files import open_regular
from common.training.planner import plan_batches
from pserver.config import PLANNERS, STALENESS

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32_BYTES = 4
MB = 1_000_000
GBIT = 1e9 / 8  # bytes per second in one Gbit/s
# ServerCosts rates a spec's ``server:`` gives as NAME_ms_per_mb
COST_RATES = ("step", "decode", "sum", "encode", "worker_decode", "worker_encode")
MAX_NODES = 100_000
MAX_SPEC_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Node:
    """One worker host.

    Attributes:
        name: the node's label (its group's name and an index).
        alpha_s: fixed compute cost of a step (seconds).
        beta_s: compute cost per sample (seconds).
        link_bytes_s: its link's rate in each direction (bytes per second).
        latency_s: one-way latency of its link (seconds).
        jitter: relative standard deviation of its compute time from round to round.
        jitter_s: absolute standard deviation added to its round time (seconds).
        transfer_s: measured time per round outside compute; when given it replaces the link
            model for this node (a node fitted from a real run).
        push_s: measured time of one async push outside compute (parameters and gradient on
            the wire, without waiting for other workers); when given it replaces the link model
            for async pushes.
    """

    name: str
    alpha_s: float
    beta_s: float
    link_bytes_s: float = 10 * GBIT
    latency_s: float = 50e-6
    jitter: float = 0.0
    jitter_s: float = 0.0
    transfer_s: float | None = None
    push_s: float | None = None

    def compute_s(self, batch: int) -> float:
        """Compute time of a step of ``batch`` samples (no jitter)."""
        return self.alpha_s + self.beta_s * batch if batch > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class ServerCosts:
    """CPU costs of the parameter-server protocol, on a shard and on a worker (the rates hold
    for the cluster's wire dtype: a bf16 wire costs casts that fp32 does not).

    Attributes:
        step_s: fixed cost of one update (seconds).
        step_s_per_byte: an update with one gradient (optimizer step and checks) per byte of
            fp32 state the shard holds.
        decode_s_per_byte: taking in one pushed piece (staging and its checks) per wire byte;
            it runs as the piece arrives.
        sum_s_per_byte: summing each further gradient of a round, per byte of fp32 state the
            shard holds.
        encode_s_per_byte: turning a new version into the wire pieces it replies with, per
            byte of fp32 state the shard holds.
        worker_decode_s_per_byte: a worker taking pulled parameters into its model, per wire
            byte of the model.
        worker_encode_s_per_byte: a worker turning its gradient into wire pieces, per byte of
            the fp32 model.
    """

    step_s: float = 0.0
    step_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    sum_s_per_byte: float = 0.0
    encode_s_per_byte: float = 0.0
    worker_decode_s_per_byte: float = 0.0
    worker_encode_s_per_byte: float = 0.0


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Everything a simulation needs besides the mode.

    Attributes:
        nodes: the worker hosts.
        model_params: parameters in the model (fp32 master weights on the shards).
        global_batch: B, samples per synchronous round.
        samples: training samples per epoch.
        wire_dtype: dtype of parameters and gradients on the wire.
        shards: K, parameter shards.
        colocated: shards run on worker hosts (shard s on node s); otherwise on their own
            server hosts with ``server_link_bytes_s``.
        server_link_bytes_s: a dedicated server host's link rate (bytes per second).
        server_latency_s: a dedicated server host's one-way latency.
        server: the shards' costs.
        staleness: the async staleness function (``pserver start --staleness``).
        max_staleness: the async staleness bound (None: no bound).
        planner: weighted-sync's planner (``pserver start --planner``).
        min_local_batch: its smallest local batch (``pserver start --min-local-batch``).
        ddp_bucket_mb: DDP's gradient bucket size (torch's default 25 MB).
        ddp_allreduce_s: measured all-reduce time per DDP step; replaces the ring model.
        backward_share: share of a step's compute spent in the backward pass (DDP overlaps
            its all-reduce with it; a parameter-server worker sends each gradient chunk as
            backward finishes it).
        chunk_mb: a push's chunk on the wire (``pserver start --chunk-mb``): the last one
            leaves after backward ends.
        shared_cores: every host's processes run on one machine with this many cores (an
            emulated cluster): a CPU stage that P hosts run at the same time takes
            max(1, P / shared_cores) times as long. None: every host has its own processor.
    """

    nodes: tuple[Node, ...]
    model_params: int
    global_batch: int
    samples: int
    wire_dtype: str = "fp32"
    shards: int = 1
    colocated: bool = True
    server_link_bytes_s: float = 10 * GBIT
    server_latency_s: float = 50e-6
    server: ServerCosts = ServerCosts()
    staleness: str = "inverse"
    max_staleness: int | None = None
    planner: str = "model"
    min_local_batch: int = 1
    ddp_bucket_mb: float = 25.0
    ddp_allreduce_s: float | None = None
    backward_share: float = 2.0 / 3.0
    chunk_mb: float = 4.0
    shared_cores: float | None = None

    def __post_init__(self) -> None:
        need(len(self.nodes) >= 1, "a cluster needs at least one node")
        need(self.model_params >= 1, f"model_params must be >= 1, got {self.model_params}")
        need(self.global_batch >= 1, f"global_batch must be >= 1, got {self.global_batch}")
        need(self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        need(self.wire_dtype in WIRE_BYTES, f"wire_dtype must be one of {list(WIRE_BYTES)}")
        need(self.shards >= 1, f"shards must be >= 1, got {self.shards}")
        need(
            not self.colocated or self.shards <= len(self.nodes),
            f"{self.shards} co-located shards need as many nodes, got {len(self.nodes)}",
        )
        for node in self.nodes:
            need(
                node.alpha_s >= 0 and node.beta_s > 0 and node.link_bytes_s > 0,
                f"node {node.name}: needs fixed >= 0, per-sample > 0 and a link > 0",
            )

    @property
    def wire_bytes(self) -> int:
        """Bytes of the model on the wire (parameters or gradient)."""
        return self.model_params * WIRE_BYTES[self.wire_dtype]

    @property
    def shard_link_bytes_s(self) -> float:
        """The slowest shard host's link rate."""
        if not self.colocated:
            return self.server_link_bytes_s
        return min(n.link_bytes_s for n in self.nodes[: self.shards])

    def with_workers(self, n: int) -> Cluster:
        """The same cluster with ``n`` nodes: groups keep their ratios (nodes are taken from
        each group in turn, repeating when ``n`` exceeds the nodes given)."""
        need(n >= 1, f"workers must be >= 1, got {n}")
        groups: dict[str, list[Node]] = {}
        for node in self.nodes:
            groups.setdefault(node.name.rsplit("#", 1)[0], []).append(node)
        counts = plan_batches({i: float(len(g)) for i, g in enumerate(groups.values())}, n)
        nodes = [
            dataclasses.replace(group[j % len(group)], name=f"{name}#{j}")
            for i, (name, group) in enumerate(groups.items())
            for j in range(counts.get(i, 0))
        ]
        shards = min(self.shards, n) if self.colocated else self.shards
        return dataclasses.replace(self, nodes=tuple(nodes), shards=shards)


# What a spec may say, section by section, and the range of every number (a hostile or
# mistyped value is refused with the section that holds it, never a traceback).
LINK_KEYS = {"gbit": (1e-6, 1e6), "latency_ms": (0.0, 1e6)}
SERVER_KEYS = {
    **LINK_KEYS,
    "step_ms": (0.0, 1e9),
    **{f"{name}_ms_per_mb": (0.0, 1e9) for name in COST_RATES},
}
GROUP_KEYS = {
    **LINK_KEYS,
    "name": None,
    "count": (1, MAX_NODES),
    "per_sample_ms": (1e-6, 1e9),
    "fixed_ms": (0.0, 1e9),
    "lognormal_sigma": (0.0, 5.0),
    "jitter": (0.0, 10.0),
}
TOP_KEYS = {
    "model_params": (1, 1e13),
    "model_mb": (1e-6, 4e7),
    "global_batch": (1, 1e9),
    "samples": (1, 1e13),
    "shards": (1, MAX_NODES),
    "max_staleness": (0, 1e9),
    "min_local_batch": (1, 1e9),
    "ddp_bucket_mb": (1e-3, 1e6),
    "backward_share": (0.0, 1.0),
    "chunk_mb": (1e-3, 1e6),
    "shared_cores": (1e-3, 1e6),
    **dict.fromkeys(("wire_dtype", "colocated", "link", "server", "groups", "staleness")),
    "planner": None,
}


class _Section:
    """One mapping of a spec, read key by key: unknown keys are refused, and every error
    names the section (``group CPU: ...``)."""

    def __init__(self, value: object, where: str, *, known: Mapping[str, Any]) -> None:
        self.where, self.known = where, known
        self.data = _mapping(value, where.strip(": ") or "the cluster spec")
        unknown = sorted(map(str, set(self.data) - set(known)))
        need(not unknown, f"{where}unknown keys {unknown}; known: {sorted(known)}")

    def number(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if isinstance(value, str):  # YAML 1.1 reads 11.7e6 (no sign in the exponent) as text
            with contextlib.suppress(ValueError):
                value = float(value)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        need(ok and math.isfinite(value), f"{self.where}{key} must be a number, got {value!r}")
        low, high = self.known[key]
        need(
            low <= value <= high, f"{self.where}{key} must be in [{low:g}, {high:g}], got {value!r}"
        )
        return float(value)


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a mapping, got {value!r}")
    return value


def load_spec(path: Path, seed: int = 0) -> Cluster:
    """The cluster of a YAML or JSON spec file (``.json`` is read as JSON).

    Raises:
        ConfigError: the file is missing, unreadable or not a regular file, or its content
            is refused (``cluster_from_spec``); the message names the file (and a syntax
            error's line).
    """
    try:
        with open_regular(path, MAX_SPEC_BYTES) as handle:
            text = handle.read().decode()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        return cluster_from_spec(_mapping(data, "its content"), seed)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"cluster spec {path}: {where}{exc.problem or exc}") from exc
    except (OSError, ValueError, yaml.YAMLError, ConfigError) as exc:
        raise ConfigError(f"cluster spec {path}: {exc}") from exc


def cluster_from_spec(spec: Mapping[str, Any], seed: int = 0) -> Cluster:
    """Build a cluster from a spec mapping (see the module docstring).

    Args:
        spec: the parsed spec.
        seed: seeds the lognormal speeds of groups that have ``lognormal_sigma``.

    Returns:
        The cluster.

    Raises:
        ConfigError: an unknown key, a missing or invalid value (the message names it and
            the section or group that holds it).
    """
    top = _Section(spec, "", known=TOP_KEYS)
    if "model_params" in spec:
        params = int(top.number("model_params"))
    else:
        params = max(1, int(top.number("model_mb") * MB / FP32_BYTES))
    link = _Section(spec.get("link", {}), "link: ", known=LINK_KEYS)
    server = _Section(spec.get("server", {}), "server: ", known=SERVER_KEYS)
    groups = spec.get("groups")
    if not isinstance(groups, Sequence) or isinstance(groups, str) or not groups:
        raise ConfigError(f"groups must be a non-empty list, got {groups!r}")
    rng = np.random.default_rng(seed)
    sections = [
        _Section(g, f"group {_name(g, i)}: ", known=GROUP_KEYS) for i, g in enumerate(groups, 1)
    ]
    total = sum(int(g.number("count", 1)) for g in sections)
    need(total <= MAX_NODES, f"the groups count {total:,} nodes; at most {MAX_NODES:,}")
    nodes = [node for group in sections for node in _group_nodes(group, link, rng)]
    max_staleness = spec.get("max_staleness")
    staleness = str(spec.get("staleness", "inverse"))
    need(staleness in STALENESS, f"staleness must be one of {list(STALENESS)}, got {staleness!r}")
    planner = str(spec.get("planner", "model"))
    need(planner in PLANNERS, f"planner must be one of {list(PLANNERS)}, got {planner!r}")
    return Cluster(
        nodes=tuple(nodes),
        model_params=params,
        global_batch=int(top.number("global_batch")),
        samples=int(top.number("samples")),
        wire_dtype=str(spec.get("wire_dtype", "fp32")),
        shards=int(top.number("shards", 1)),
        colocated=bool(spec.get("colocated", True)),
        server_link_bytes_s=server.number("gbit", link.number("gbit", 10)) * GBIT,
        server_latency_s=server.number("latency_ms", link.number("latency_ms", 0.05)) / 1e3,
        server=ServerCosts(
            step_s=server.number("step_ms", 0.0) / 1e3,
            **{
                f"{name}_s_per_byte": server.number(f"{name}_ms_per_mb", 0.0) / 1e3 / MB
                for name in COST_RATES
            },
        ),
        staleness=staleness,
        max_staleness=None if max_staleness is None else int(top.number("max_staleness")),
        planner=planner,
        min_local_batch=int(top.number("min_local_batch", 1)),
        ddp_bucket_mb=top.number("ddp_bucket_mb", 25.0),
        backward_share=top.number("backward_share", 2.0 / 3.0),
        chunk_mb=top.number("chunk_mb", 4.0),
        shared_cores=None if spec.get("shared_cores") is None else top.number("shared_cores"),
    )


def _name(group: object, index: int) -> str:
    name = group.get("name") if isinstance(group, Mapping) else None
    return str(name) if name is not None else f"#{index}"


def _group_nodes(group: _Section, link: _Section, rng: np.random.Generator) -> list[Node]:
    name = str(group.data.get("name", "node"))
    count = int(group.number("count", 1))
    per_sample = group.number("per_sample_ms") / 1e3
    fixed = group.number("fixed_ms", 0.0) / 1e3
    sigma = group.number("lognormal_sigma", 0.0)
    factors = rng.lognormal(0.0, sigma, count) if sigma > 0 else np.ones(count)
    gbit = group.number("gbit", link.number("gbit", 10))
    latency = group.number("latency_ms", link.number("latency_ms", 0.05)) / 1e3
    return [
        Node(
            name=f"{name}#{i}",
            alpha_s=fixed * float(f),
            beta_s=per_sample * float(f),
            link_bytes_s=gbit * GBIT,
            latency_s=latency,
            jitter=group.number("jitter", 0.0),
        )
        for i, f in enumerate(factors)
    ]
