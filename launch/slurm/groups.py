"""Worker groups of a Slurm job: one for a plain job, one per hetjob component (``--het``)."""

from __future__ import annotations

import dataclasses
import re

from common.config import need
from common.errors import ConfigError

HET_HELP = (
    "Make a heterogeneous job: components separated by ';', each NAME:key=value,... . "
    "Keys: partition, nodes, workers, cpus (per worker), gpus (per node; one worker per GPU "
    "unless workers= is given, then the workers share the node's GPUs), gpus-per-worker, "
    "slowdown (emulated, for every worker of the component), constraint, shards (parameter "
    "shard servers on the component's nodes). A first component "
    "named 'server' holds only the server (keys partition, cpus, constraint); without it the "
    "server runs on the first node of the first component. Example: "
    "'server:partition=cpu;gpu:partition=gpu,nodes=2,gpus=4;cpu:partition=cpu,nodes=4,cpus=8'."
)

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
_VALUE = re.compile(r"^[A-Za-z0-9_.:\[\]&|!*-]+$")
_WORKER_KEYS: tuple[str, ...] = ("partition", "nodes", "workers", "cpus", "gpus")
_WORKER_KEYS += ("gpus-per-worker", "slowdown", "constraint", "shards")
_SERVER_KEYS = ("partition", "cpus", "constraint")


@dataclasses.dataclass(frozen=True)
class Group:
    """Workers that share one resource request.

    Attributes:
        name: the component's name (also in worker names), ``workers`` for a plain job.
        slowdowns: one emulated slowdown per worker, in task order.
        cpus: CPUs per worker (also its torch threads).
        nodes: nodes for the group (None: Slurm chooses).
        partition, constraint: Slurm's ``--partition`` and ``--constraint`` (None: default).
        gpus_per_worker: GPUs each worker task gets for itself (``--gpus-per-task``).
        gpus_per_node: GPUs per node shared by the node's workers (``--gpus-per-node``); a
            worker then uses GPU ``SLURM_LOCALID`` modulo the GPUs it sees.
        tasks_per_node: workers per node (``--ntasks-per-node``; None: Slurm chooses).
        shards: parameter shard servers (``pserver shard``) on the group's nodes, spread
            one per node before any node gets a second.
    """

    name: str
    slowdowns: tuple[float, ...]
    cpus: int = 1
    nodes: int | None = None
    partition: str | None = None
    constraint: str | None = None
    gpus_per_worker: int = 0
    gpus_per_node: int = 0
    tasks_per_node: int | None = None
    shards: int = 0

    @property
    def workers(self) -> int:
        """Number of worker tasks."""
        return len(self.slowdowns)

    @property
    def gpus(self) -> bool:
        """The workers compute on GPUs."""
        return self.gpus_per_worker > 0 or self.gpus_per_node > 0

    def validate(self) -> Group:
        """Check the counts.

        Returns:
            ``self``.

        Raises:
            ConfigError: a count is out of range; the message names the group and the value.
        """
        where = f"worker group {self.name!r}"
        need(self.slowdowns, f"{where} has no workers")
        if any(f < 1 for f in self.slowdowns):
            raise ConfigError(f"{where}: slowdowns must be >= 1, got {list(self.slowdowns)}")
        need(self.cpus >= 1, f"{where}: cpus must be >= 1, got {self.cpus}")
        if self.nodes is not None and not 1 <= self.nodes <= self.workers:
            raise ConfigError(
                f"{where}: nodes must be between 1 and its {self.workers} workers, got {self.nodes}"
            )
        need(
            0 <= self.shards <= self.workers * self.cpus,
            f"{where}: shards must be between 0 and its {self.workers * self.cpus} CPUs, "
            f"got {self.shards}",
        )
        if self.gpus_per_worker < 0 or self.gpus_per_node < 0:
            raise ConfigError(f"{where}: GPU counts must be >= 0")
        if self.gpus_per_worker and self.gpus_per_node:
            raise ConfigError(f"{where}: give gpus (per node) or gpus-per-worker, not both")
        if self.tasks_per_node is not None and (
            self.nodes is None or self.nodes * self.tasks_per_node != self.workers
        ):
            raise ConfigError(f"{where}: {self.tasks_per_node} workers per node need nodes=")
        return self


@dataclasses.dataclass(frozen=True)
class ServerPlace:
    """Where the server runs in a heterogeneous job with its own ``server`` component.

    Attributes:
        partition, constraint: as for ``Group``.
        cpus: CPUs for the server.
    """

    partition: str | None = None
    cpus: int = 1
    constraint: str | None = None


def _int(text: str, key: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--het {where}: {key}={text!r} is not a whole number") from None
    need(value >= 0, f"--het {where}: {key} must be >= 0, got {value}")
    return value


def _pairs(body: str, where: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``, checking keys and characters."""
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in body.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        need(sep and value, f"--het {where}: {item!r} is not key=value")
        need(key in allowed, f"--het {where}: unknown key {key!r}; use {', '.join(allowed)}")
        need(key not in pairs, f"--het {where}: {key} is given twice")
        need(
            _VALUE.match(value),
            f"--het {where}: {key}={value!r} has characters Slurm does not take",
        )
        pairs[key] = value
    return pairs


def _worker_group(name: str, pairs: dict[str, str]) -> Group:
    where = f"component {name!r}"
    nodes = _int(pairs["nodes"], "nodes", where) if "nodes" in pairs else None
    gpus = _int(pairs.get("gpus", "0"), "gpus", where)
    per_worker = _int(pairs.get("gpus-per-worker", "0"), "gpus-per-worker", where)
    per_node: int | None = None
    if "workers" in pairs:
        workers = _int(pairs["workers"], "workers", where)
    elif gpus > 0 and not per_worker:
        # gpus=G alone: G workers on each node, each with a GPU of its own.
        nodes = nodes or 1
        per_node, per_worker, gpus = gpus, 1, 0
        workers = nodes * per_node
    else:
        workers = nodes or 1
    try:
        slowdown = float(pairs.get("slowdown", "1"))
    except ValueError:
        text = pairs["slowdown"]
        raise ConfigError(f"--het {where}: slowdown={text!r} is not a number") from None
    return Group(
        name=name,
        slowdowns=(slowdown,) * workers,
        cpus=_int(pairs.get("cpus", "1"), "cpus", where),
        nodes=nodes,
        partition=pairs.get("partition"),
        constraint=pairs.get("constraint"),
        gpus_per_worker=per_worker,
        gpus_per_node=gpus,
        tasks_per_node=per_node,
        shards=_int(pairs.get("shards", "0"), "shards", where),
    ).validate()


def spread_shards(groups: tuple[Group, ...], shards: int) -> tuple[Group, ...]:
    """Give ``shards`` shard servers to the groups, round-robin, unless they name their own.

    Args:
        groups: the worker groups.
        shards: ``--shards K`` (0: as the groups say).

    Returns:
        The groups with their ``shards`` set.

    Raises:
        ConfigError: the groups name shards that do not add up to ``shards``.
    """
    named = sum(g.shards for g in groups)
    if shards in (0, named):
        return groups
    need(not named, f"--shards {shards} but the --het components hold {named}")
    counts = [shards // len(groups) + (i < shards % len(groups)) for i in range(len(groups))]
    return tuple(dataclasses.replace(g, shards=k) for g, k in zip(groups, counts, strict=True))


def parse_het(spec: str) -> tuple[ServerPlace | None, tuple[Group, ...]]:
    """Parse a ``--het`` spec into the server's component (if any) and the worker groups.

    Args:
        spec: ``NAME:key=value,...;NAME:...`` (see ``HET_HELP``).

    Returns:
        ``(server, groups)``: ``server`` is None when the server shares the first group's
        first node.

    Raises:
        ConfigError: malformed text, an unknown key, a duplicate name, or no worker group.
    """
    server: ServerPlace | None = None
    groups: list[Group] = []
    names: set[str] = set()
    parts = [part.strip() for part in spec.split(";") if part.strip()]
    for index, part in enumerate(parts):
        name, sep, body = part.partition(":")
        name = name.strip()
        need(
            _NAME.match(name),
            f"--het component name {name!r} must start with a letter and use only letters, "
            "digits, '-' and '_'",
        )
        need(name not in names, f"--het names component {name!r} twice")
        names.add(name)
        if name == "server":
            need(index == 0, "--het: the 'server' component must come first")
            pairs = _pairs(body if sep else "", "component 'server'", _SERVER_KEYS)
            cpus = _int(pairs.get("cpus", "1"), "cpus", "component 'server'")
            need(cpus >= 1, f"--het component 'server': cpus must be >= 1, got {cpus}")
            server = ServerPlace(pairs.get("partition"), cpus, pairs.get("constraint"))
        else:
            groups.append(_worker_group(name, _pairs(body if sep else "", name, _WORKER_KEYS)))
    need(groups, f"--het {spec!r} has no worker component")
    return server, tuple(groups)
