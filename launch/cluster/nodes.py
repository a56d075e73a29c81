"""The CPU budgets of one launch's emulated nodes: the control group each process it starts (a
worker, a DDP rank, the server, a shard) runs in, and their teardown. The nodes' hosts and
links are ``launch.cluster.netns``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from common.errors import PSError
from launch.cluster.budgets import CpuBudgets, check_total, require_hierarchy
from launch.cluster.spec import ClusterSpec, NodeSpec


@dataclasses.dataclass(frozen=True)
class Node:
    """Where one process runs.

    Attributes:
        name: the process's name (``w0``, ``server``, ``shard1``).
        spec: its budget and link.
        group: its CPU-quota control group, None without a budget.
    """

    name: str
    spec: NodeSpec = dataclasses.field(default_factory=NodeSpec)
    group: Path | None = None

    def argv(self, command: Sequence[str]) -> list[str]:
        """The command line that runs ``command`` on this node: inside its control group
        (outermost, see ``CpuBudgets.wrap``)."""
        argv = list(command)
        if self.group is not None:
            argv = CpuBudgets.wrap(self.group, argv)
        return argv


class Nodes:
    """The nodes of one launch, as a context manager that removes their control groups on
    every exit path.

    Args:
        spec: the emulated cluster, None to run every process as it is.
        shards: how many shard processes the run starts beside the server (each takes the
            server's budget).
        server: whether the run has a server (False for DDP: only ranks).
        allow_oversubscribe: accept budgets that sum to more cores than the machine has.

    Raises:
        ConfigError: (on entry) the budgets oversubscribe the machine, or budgets were asked
            for without root or without a cpu controller.
    """

    def __init__(
        self,
        spec: ClusterSpec | None,
        shards: int = 0,
        *,
        server: bool = True,
        allow_oversubscribe: bool = False,
    ) -> None:
        self.spec = spec
        self.shards, self.has_server = shards, server
        self.allow_oversubscribe = allow_oversubscribe
        self.budgets: CpuBudgets | None = None

    def __enter__(self) -> Nodes:
        return self.open()

    def open(self) -> Nodes:
        """Check the spec and prepare the control groups' parent (``close`` undoes it).

        Raises:
            ConfigError: as the class says.
        """
        spec = self.spec
        if spec is None:
            return self
        if spec.budgets:
            check_total(self.total_budgets(), self.allow_oversubscribe)
            self.budgets = CpuBudgets(require_hierarchy())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every control group (killing what still runs in one)."""
        if self.budgets is not None:
            self.budgets.close()

    def total_budgets(self) -> list[float]:
        """Every budgeted process's cores (a scheduled node's largest): workers (or ranks), the
        server and its shards."""
        assert self.spec is not None
        cores = [n.peak_cpus for n in self.spec.workers if n.peak_cpus is not None]
        if self.has_server and self.spec.server.cpus is not None:
            cores += [self.spec.server.cpus] * (1 + self.shards)
        return cores

    def _node(self, name: str, spec: NodeSpec) -> Node:
        group = None
        if self.budgets is not None and spec.cpus is not None:
            group = self.budgets.group(name, spec.cpus)
        return Node(name, spec, group)

    def worker(self, index: int) -> Node:
        """The node of worker (or DDP rank) ``index``."""
        if self.spec is None:
            return Node(f"w{index}")
        return self._node(f"w{index}", self.spec.workers[index])

    def set_budget(self, index: int, cores: float) -> None:
        """Rewrite the CPU quota of worker (or DDP rank) ``index`` to ``cores``; what runs in
        its group keeps running under the new budget.

        Raises:
            PSError: the launch has no CPU budgets, or the quota cannot be written.
        """
        if self.budgets is None:
            raise PSError(f"worker {index} has no CPU budget to change")
        self.budgets.set_quota(self.budgets.parent / f"w{index}", cores)

    def server(self) -> Node:
        """The server's node."""
        return Node("server") if self.spec is None else self._node("server", self.spec.server)

    def shard(self, index: int) -> Node:
        """The node of shard ``index`` (the server's budget)."""
        name = f"shard{index}"
        return Node(name) if self.spec is None else self._node(name, self.spec.server)
