"""DDP under its nodes' budget schedules, restarted the way ``torchrun`` restarts a group.

A budget change rewrites the node's CPU quota while its rank runs. A node that leaves
(``off``) has its rank killed with SIGKILL; the group cannot go on without it, so the other
ranks are killed too and the remaining ones restart from the run's last checkpoint (an elastic
restart). A node that returns (``on``) restarts the group again, with it, from the last
checkpoint. The points are found by following rank 0's ``metrics.jsonl`` events
(``ScheduleFollower``): a restarted group's ``resume`` event sets the work done back to its
checkpoint. Restarts, the work they threw away (samples applied after the checkpoint they went
back to) and their time (from the failure to the new group's first step) are counted.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.errors import PSError
from common.polling import poll_until
from common.procs import Children
from launch.cluster.nodes import Nodes
from launch.cluster.schedule import OFF, ON, ScheduleFollower, ScheduleRunner
from launch.procs import POLL_S, EventTail

log = logging.getLogger(__name__)

StartGroup = Callable[[Sequence[int], bool], Children]


@dataclasses.dataclass
class Restarts:
    """What the restarts of a run cost.

    Attributes:
        count: groups restarted.
        lost_samples: samples applied and then thrown away (applied after the checkpoint the
            next group went back to).
        restart_s: seconds from each failure to the next group's first step, summed.
    """

    count: int = 0
    lost_samples: int = 0
    restart_s: float = 0.0


class ElasticGroups:
    """Runs DDP groups until one ends, following the nodes' schedules.

    Args:
        follower: the nodes' schedules, followed by the run's progress.
        world_size: the nodes (each runs one rank while it is on).
        resume: the first group resumes from the last checkpoint.
        origin: the run's start on the ``time.monotonic`` clock (None: 0).
        start: starts the ranks of the nodes given, by index (resuming from the last
            checkpoint when told), and returns them.
        budgets: the nodes' CPU budgets (``Nodes.set_budget``).
        metrics: rank 0's ``metrics.jsonl``, read from where this run's events begin.
    """

    def __init__(
        self,
        *,
        follower: ScheduleFollower,
        world_size: int,
        resume: bool,
        origin: float | None,
        start: StartGroup,
        budgets: Nodes,
        metrics: EventTail,
    ) -> None:
        self.world_size, self.resume, self.origin = world_size, resume, origin
        self.start, self.budgets, self.metrics = start, budgets, metrics
        self.runner = ScheduleRunner(follower, self)
        self.pending: list[tuple[int, str]] = []  # nodes leaving or returning, not yet acted on
        self.restarts = Restarts()
        self.group: Children | None = None
        self.applied = 0  # samples applied, as the events tell (a resume sets it back)
        self._failed: tuple[float, int] | None = None  # run time and samples at the failure

    def run(self, timeout_s: float) -> Restarts:
        """Run groups until one finishes.

        Raises:
            PSError: a rank failed on its own, or the run took longer than ``timeout_s``.
        """
        members, resume = list(range(self.world_size)), self.resume
        deadline = time.monotonic() + timeout_s
        while True:
            self.group = self.start(members, resume)
            changes = self._watch(self.group, deadline)
            if changes is None:
                self.group.close()
                return self.restarts
            for index, action in changes:  # a departing node's rank dies first, as it fails
                if action == OFF:
                    self.group.children[members.index(index)].signal_group(signal.SIGKILL)
            self.group.kill_groups()  # the group cannot go on: the others are stopped
            for child in self.group.children:
                child.wait()
            self.group.close()
            self.runner.step(self._take(self.metrics.read()))  # the steps before the failure
            self._failed = (time.monotonic() - (self.origin or 0.0), self.applied)
            for index, action in changes:
                members = [m for m in members if m != index] if action == OFF else [*members, index]
                log.info("node %d %s: restarting the group from its last checkpoint", index, action)
            members, resume = sorted(members), True
            self.restarts.count += 1
            _drop_partial_line(self.metrics.path)  # a killed rank 0 may have half written one

    def stop(self) -> None:
        """Stop the running group (SIGTERM, then SIGKILL after a grace period)."""
        if self.group is not None:
            self.group.stop()
            self.group.close()

    def _watch(self, group: Children, deadline: float) -> list[tuple[int, str]] | None:
        """Follow the group until it ends (None) or a node leaves or returns (those changes)."""

        def step() -> tuple[list[tuple[int, str]]] | None:
            self.runner.step(self._take(self.metrics.read()))
            leaving, self.pending = self.pending, []
            codes = [child.code for child in group.children]
            for child, code in zip(group.children, codes, strict=True):
                if code not in (None, 0):
                    raise PSError(f"DDP rank {child.failure()}")
            if all(code == 0 for code in codes):  # finished (a change due now comes too late)
                self.runner.step(self._take(self.metrics.read()))
                return ([],)
            return (leaving,) if leaving else None

        left = max(deadline - time.monotonic(), 0.0)
        (leaving,) = poll_until(step, left, POLL_S, "every DDP rank to finish")
        return leaving or None

    def set_budget(self, index: int, cores: float) -> None:
        """Rewrite node ``index``'s CPU quota while its rank runs."""
        self.budgets.set_budget(index, cores)
        log.info("node %d now has %g cores", index, cores)

    def leave(self, index: int) -> None:
        """Node ``index`` leaves: its rank is killed and the group restarted without it."""
        self.pending.append((index, OFF))

    def rejoin(self, index: int) -> None:
        """Node ``index`` returns: the group is restarted with it."""
        self.pending.append((index, ON))

    def _take(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Count the work and the restarts' cost from rank 0's events; return them."""
        for event in events:
            kind = event.get("event")
            if kind == "resume" and isinstance(event.get("samples"), int):
                self.applied = event["samples"]
                if self._failed is not None:
                    self.restarts.lost_samples += self._failed[1] - self.applied
            elif kind == "round":
                self.applied += sum(int(w.get("batch", 0)) for w in event.get("workers", ()))
                if self._failed is not None:  # the first step after a restart
                    self.restarts.restart_s += float(event["t"]) - self._failed[0]
                    self._failed = None
        return events


def _drop_partial_line(path: Path) -> None:
    """Cut ``path`` after its last complete line."""
    if path.exists():
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with path.open("r+b") as handle:
                handle.truncate(end)
