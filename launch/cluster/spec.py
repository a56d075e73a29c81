"""The node spec of an emulated cluster: each node's CPU budget and link, and named presets."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from common.config import need
from common.errors import ConfigError
from launch.cluster.schedule import Change, parse_schedule, schedule_text

RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
RATE_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")


def rate_bits(rate: str) -> int:
    """Parse a tc rate such as ``1gbit`` or ``100mbit``.

    Args:
        rate: a number followed by bit, kbit, mbit or gbit (decimal units, as tc reads them).

    Returns:
        The rate in bits per second.

    Raises:
        ConfigError: the text is not such a rate, or it is zero.
    """
    match = RATE.match(rate.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"a link rate looks like 1gbit or 100mbit, got {rate!r}")
    return int(float(match.group(1)) * RATE_UNITS[match.group(2)])


def delay_ms(delay: str) -> float:
    """Parse a one-way link delay such as ``2ms``, ``500us`` or ``0.1s``.

    Raises:
        ConfigError: the text is not such a delay, or it exceeds 10 s.
    """
    match = DELAY.match(delay.strip().lower())
    if not match:
        raise ConfigError(f"a link delay looks like 2ms, 500us or 0.1s, got {delay!r}")
    value = float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]
    need(value <= 10_000, f"a link delay must be at most 10s, got {delay!r}")
    return value


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One emulated node.

    Attributes:
        cpus: the node's CPU budget in cores (e.g. 0.4) at the start, None for no budget.
        link: the node's link rate as tc writes it (e.g. ``1gbit``), None for no own link.
        schedule: later changes of the budget, and the node leaving and returning
            (``launch.cluster.schedule``); empty for a static node.
    """

    cpus: float | None = None
    link: str | None = None
    schedule: tuple[Change, ...] = ()

    @property
    def peak_cpus(self) -> float | None:
        """The largest budget the node ever has (None without a budget)."""
        if self.cpus is None:
            return None
        return max([self.cpus, *(c.cores for c in self.schedule if c.cores is not None)])

    def validate(self, what: str) -> NodeSpec:
        """Check the budgets and the rate; ``what`` names the node in errors.

        Raises:
            ConfigError: quoting the bad value.
        """
        if self.schedule and self.cpus is None:
            raise ConfigError(f"{what}: a budget schedule needs a starting budget")
        for cores in (self.cpus, *(c.cores for c in self.schedule)):
            if cores is not None and not 0.01 <= cores <= 1024:
                raise ConfigError(f"{what}: a CPU budget is in [0.01, 1024] cores, got {cores}")
        if self.link is not None:
            rate_bits(self.link)
        return self

    def describe(self) -> dict[str, Any]:
        """The node as JSON-ready data (the schedule as ``parse_schedule`` reads it)."""
        return {
            "cpus": self.cpus,
            "link": self.link,
            "schedule": schedule_text(self.cpus, self.schedule) if self.schedule else None,
        }

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> NodeSpec:
        """The node ``describe`` wrote (descriptions without a schedule are static nodes)."""
        text = data.get("schedule")
        cpus, schedule = parse_schedule(text) if text else (data["cpus"], ())
        return cls(cpus=cpus, link=data["link"], schedule=schedule)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster: one node per worker (or DDP rank) and one for the server.

    Attributes:
        workers: per worker, in ``--workers``/``--slowdowns`` order.
        server: the coordinator's node (shards not co-located take the same budget).
        link_delay: one-way delay added on every link (``--link-delay``), None for none.
        name: the preset it came from, None when given option by option.
    """

    workers: tuple[NodeSpec, ...]
    server: NodeSpec = NodeSpec()
    link_delay: str | None = None
    name: str | None = None

    @property
    def budgets(self) -> bool:
        """Whether any process runs under a CPU budget."""
        return self.server.cpus is not None or any(n.cpus is not None for n in self.workers)

    @property
    def scheduled(self) -> bool:
        """Whether any worker node's budget changes, or the node leaves, during the run."""
        return any(n.schedule for n in self.workers)

    @property
    def links(self) -> bool:
        """Whether nodes get their own hosts and capped links."""
        return self.server.link is not None or any(n.link is not None for n in self.workers)

    def validate(self) -> ClusterSpec:
        """Check every node and the delay.

        Raises:
            ConfigError: quoting the bad value.
        """
        need(self.workers, "an emulated cluster needs at least one worker node")
        for index, node in enumerate(self.workers):
            node.validate(f"worker {index}")
        self.server.validate("server")
        if self.link_delay is not None:
            need(self.links, "--link-delay needs --links (or a preset with links)")
            delay_ms(self.link_delay)
        if self.links and any(n.link is None for n in self.workers):
            raise ConfigError("--links must give every worker a link (one value applies to all)")
        return self

    def describe(self) -> dict[str, Any]:
        """The spec as JSON-ready data, as reports, compare.json and summaries record it."""
        return {
            "name": self.name,
            "workers": [n.describe() for n in self.workers],
            "server": self.server.describe(),
            "link_delay": self.link_delay,
        }

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """The spec ``describe`` wrote.

        Raises:
            ConfigError: the data is not such a description, or a value is invalid.
        """
        try:
            return cls(
                workers=tuple(NodeSpec.from_description(n) for n in data["workers"]),
                server=NodeSpec.from_description(data["server"]),
                link_delay=data.get("link_delay"),
                name=data.get("name"),
            ).validate()
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not an emulated cluster's description: {exc}") from exc

    def summary_line(self) -> str:
        """One line for a report: the name, each node's budget and link, the server's."""

        def node(n: NodeSpec) -> str:
            cpus = "-" if n.cpus is None else f"{n.cpus:g}"
            if n.schedule:
                cpus = f"({schedule_text(n.cpus, n.schedule)})"
            return cpus + (f" on {n.link}" if n.link else "")

        workers = "/".join(node(n) for n in self.workers)
        text = f"workers {workers} cores, server {node(self.server)}"
        if self.link_delay:
            text += f", link delay {self.link_delay}"
        return (f"{self.name}: " if self.name else "") + text


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named emulated cluster: per-worker budgets (each a ``--node-cpus`` entry, so it may be
    a schedule) and links, the server's node."""

    description: str
    node_cpus: tuple[str, ...]
    server_cpus: float | None = None
    links: tuple[str, ...] | None = None
    server_link: str | None = None

    def spec(self, name: str) -> ClusterSpec:
        """The preset as a cluster spec named ``name``."""
        links = self.links or (None,) * len(self.node_cpus)
        nodes = []
        for entry, link in zip(self.node_cpus, links, strict=True):
            cpus, schedule = parse_schedule(entry)
            nodes.append(NodeSpec(cpus, link, schedule))
        return ClusterSpec(
            workers=tuple(nodes), server=NodeSpec(self.server_cpus, self.server_link), name=name
        ).validate()


PRESETS: Mapping[str, Preset] = {
    "small-1124": Preset(
        "four CPU nodes at 0.4/0.4/0.2/0.1 cores (speeds 4:4:2:1), server 0.5 core",
        node_cpus=("0.4", "0.4", "0.2", "0.1"),
        server_cpus=0.5,
    ),
    "shifting-load": Preset(
        "small-1124 whose node 0 drops from 0.4 to 0.05 core for the middle third of the run "
        "while node 3 rises from 0.1 to 0.4 core, server 0.5 core",
        node_cpus=("0.4;0.05@33.3%;0.4@66.7%", "0.4", "0.2", "0.1;0.4@33.3%;0.1@66.7%"),
        server_cpus=0.5,
    ),
    "leave-return": Preset(
        "small-1124 whose node 1 (0.4 core) is off for the middle third of the run, server "
        "0.5 core",
        node_cpus=("0.4", "0.4;off@33.3%;on@66.7%", "0.2", "0.1"),
        server_cpus=0.5,
    ),
    "wide-70-25-5": Preset(
        "three nodes at 0.7/0.25/0.05 cores (a fast, a middling and a very slow node), "
        "server 0.5 core",
        node_cpus=("0.7", "0.25", "0.05"),
        server_cpus=0.5,
    ),
    "hosts-3x1g": Preset(
        "three worker hosts at 0.5/0.5/0.25 cores, each on its own 1 Gbit/s link; the server "
        "on its own 1 Gbit/s host with 0.5 core",
        node_cpus=("0.5", "0.5", "0.25"),
        server_cpus=0.5,
        links=("1gbit", "1gbit", "1gbit"),
        server_link="1gbit",
    ),
}


def _per_worker(text: str, option: str, count: int) -> list[str]:
    """Split a comma list; one value applies to all ``count`` workers."""
    items = [item.strip() for item in text.split(",")]
    need(all(items), f"{option} {text!r} has an empty entry")
    if len(items) == 1:
        return items * count
    need(len(items) == count, f"{option} {text!r} has {len(items)} entries for {count} workers")
    return items


def parse_cluster(
    workers: int,
    preset: str | None = None,
    node_cpus: str | None = None,
    server_cpus: float | None = None,
    links: str | None = None,
    server_link: str | None = None,
    link_delay: str | None = None,
) -> ClusterSpec | None:
    """Build the emulated cluster from the launcher's options.

    A preset fixes the worker count; options given beside it override its fields.

    Args:
        workers: the number of workers (or DDP ranks).
        preset: a name from ``PRESETS``.
        node_cpus: cores per worker, comma-separated, or one value for all; an entry may be
            a schedule (``launch.cluster.schedule``).
        server_cpus: the server's cores.
        links: a tc rate per worker, comma-separated, or one for all.
        server_link: the server's rate (default: the fastest worker link).
        link_delay: one-way delay on every link.

    Returns:
        The validated spec, or None when nothing is emulated.

    Raises:
        ConfigError: an unknown preset, a count that does not match, or a bad value.
    """
    base: ClusterSpec | None = None
    if preset is not None:
        need(preset in PRESETS, f"--cluster {preset!r} is not one of {', '.join(sorted(PRESETS))}")
        base = PRESETS[preset].spec(preset)
        need(
            len(base.workers) == workers,
            f"--cluster {preset} has {len(base.workers)} workers, got --workers {workers}",
        )
    if base is None and not (node_cpus or server_cpus is not None or links or server_link):
        need(link_delay is None, "--link-delay needs --links (or a preset with links)")
        return None
    nodes = list(base.workers) if base else [NodeSpec()] * workers
    if node_cpus:
        cpus = _per_worker(node_cpus, "--node-cpus", workers)
        parsed = [parse_schedule(c) for c in cpus]
        nodes = [
            dataclasses.replace(n, cpus=c, schedule=schedule)
            for n, (c, schedule) in zip(nodes, parsed, strict=True)
        ]
    if links:
        rates = _per_worker(links, "--links", workers)
        nodes = [dataclasses.replace(n, link=r.lower()) for n, r in zip(nodes, rates, strict=True)]
    server = base.server if base else NodeSpec()
    if server_cpus is not None:
        server = dataclasses.replace(server, cpus=server_cpus)
    if server_link:
        server = dataclasses.replace(server, link=server_link.lower())
    elif server.link is None and any(n.link for n in nodes):
        server = dataclasses.replace(
            server, link=max((n.link for n in nodes if n.link), key=rate_bits)
        )
    overridden = bool(node_cpus or links or server_cpus is not None or server_link)
    name = None if base is None else preset if not overridden else f"{preset} (modified)"
    return ClusterSpec(
        workers=tuple(nodes), server=server, link_delay=link_delay, name=name
    ).validate()
