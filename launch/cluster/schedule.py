"""A node's budget schedule: its CPU budget changes, or the node leaves and returns, at points
of the run.

Written per node in ``--node-cpus`` as steps separated by ``;``: the first is the starting
budget, every later one ``VALUE@POINT``. ``VALUE`` is a budget in cores, ``off`` (the node's
process is killed) or ``on`` (it is started again, with the budget it had when it left).
``POINT`` is ``N%``, a share of the run's training work (samples: epochs x the training split;
updates with only ``--max-steps``), so every mode meets a change after the same work, or
``Ns``, seconds of training. Example: ``0.4;0.05@33.3%;0.4@66.7%`` (a 0.4-core node slowed to
0.05 core for the middle third), ``0.4;off@33.3%;on@66.7%`` (off for the middle third).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from common.config import need
from common.errors import ConfigError
from launch.progress import RunProgress

log = logging.getLogger(__name__)

STEP = re.compile(r"^(?P<value>[^@]+)@(?P<at>\d+(?:\.\d+)?)(?P<unit>%|s)?$")
OFF, ON = "off", "on"


@dataclasses.dataclass(frozen=True)
class Change:
    """One step of a schedule.

    Attributes:
        at: the point: a share of the run's work in (0, 1) (``share``) or seconds of training.
        share: True when ``at`` is a share of the run, False when it is seconds.
        cores: the node's budget from this point on; None while it is off.
        action: ``budget`` (a new budget), ``off`` or ``on``.
    """

    at: float
    share: bool
    cores: float | None
    action: str = "budget"

    def reached(self, share: float, seconds: float) -> bool:
        """Whether a run that did ``share`` of its work in ``seconds`` of training is past it."""
        return (share if self.share else seconds) >= self.at

    def text(self) -> str:
        """The step as written on the command line."""
        value = self.action if self.action != "budget" else f"{self.cores:g}"
        return f"{value}@{self.at * 100:g}%" if self.share else f"{value}@{self.at:g}s"


def parse_schedule(text: str, option: str = "--node-cpus") -> tuple[float, tuple[Change, ...]]:
    """Parse one node's entry: a budget, or a budget followed by ``;VALUE@POINT`` steps.

    Args:
        text: the node's entry, e.g. ``0.4;off@33.3%;on@66.7%``.
        option: the option named in errors.

    Returns:
        The starting budget and the later changes, in order.

    Raises:
        ConfigError: a step that is not ``VALUE@POINT``, points not increasing or not within
            the run, ``on`` without ``off`` before it, a budget while the node is off, or a
            node still off at the end of the run.
    """
    first, *rest = (part.strip() for part in text.split(";"))
    start = _cores(first.removesuffix("@0%").removesuffix("@0"), option, text)
    changes: list[Change] = []
    cores: float | None = start
    last = 0.0
    for part in rest:
        match = STEP.match(part)
        if match is None:
            raise ConfigError(f"{option} step {part!r} of {text!r} is not VALUE@N% or VALUE@Ns")
        share = match["unit"] != "s"
        at = round(float(match["at"]) / (100 if share else 1), 9)
        if changes and changes[-1].share != share:
            raise ConfigError(f"{option} {text!r} mixes % and s points; give one kind per node")
        if at <= last or (share and at >= 1):
            raise ConfigError(
                f"{option} {text!r}: points must increase and lie inside the run, got {part!r}"
            )
        last, value = at, match["value"].strip().lower()
        if value == OFF:
            need(cores is not None, f"{option} {text!r}: the node is already off at {part!r}")
            changes.append(Change(at, share, None, OFF))
            kept, cores = cores, None
        elif value == ON:
            need(cores is None, f"{option} {text!r}: 'on' at {part!r} without 'off' before it")
            cores = kept
            changes.append(Change(at, share, cores, ON))
        else:
            need(
                cores is not None, f"{option} {text!r}: a budget at {part!r} while the node is off"
            )
            cores = _cores(value, option, text)
            changes.append(Change(at, share, cores))
    need(cores is not None, f"{option} {text!r}: the node must come back ('on@...') before the end")
    return start, tuple(changes)


def schedule_text(cores: float | None, changes: tuple[Change, ...]) -> str:
    """A node's entry as ``parse_schedule`` reads it ("-" for no budget)."""
    return ";".join(["-" if cores is None else f"{cores:g}", *(c.text() for c in changes)])


def _cores(value: str, option: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(
            f"{option} takes cores such as 0.4 (or a schedule such as 0.4;0.05@33%;0.4@66%), "
            f"got {text!r}"
        ) from None


class ScheduleFollower(RunProgress):
    """Which schedule changes a run has reached, from the events of its ``metrics.jsonl``.

    The run's work is counted as ``RunProgress`` counts it (samples of ``round`` and ``push``
    events; updates with only ``max_steps``); a ``resume`` event that carries ``samples`` (a
    restart from a checkpoint) sets the count back to it. Times are on the run's clock (the
    events' ``t``), read off this process's clock less the smallest lag seen between an
    event's ``t`` and its reading; seconds of training run from the ``train_start`` event.
    Once the run logs ``finish``, no change is due any more: a node is not taken out or
    brought back while the run ends.

    Args:
        schedules: per node, its changes (``NodeSpec.schedule``).
        epochs: the run's ``--epochs`` (None: not given).
        max_steps: the run's ``--max-steps`` (None: not given).
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        schedules: Sequence[tuple[Change, ...]],
        *,
        epochs: int | None,
        max_steps: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(epochs, max_steps, enabled=False)
        self.schedules = list(schedules)
        self.next = [0] * len(self.schedules)
        self.clock = clock
        self.started: float | None = None
        self.finished = False
        self.lag: float | None = None  # this clock less the run's, at the quickest reading

    def feed(self, record: dict[str, Any]) -> None:
        """Take one event into account (unknown events are ignored)."""
        super().feed(record)
        kind, t = record.get("event"), record.get("t")
        if isinstance(t, int | float) and not isinstance(t, bool):
            lag = self.clock() - t
            self.lag = lag if self.lag is None else min(self.lag, lag)
        if kind == "train_start" and self.started is None:
            self.started = t if isinstance(t, int | float) else self.now()
        elif kind == "finish":
            self.finished = True

    @property
    def share(self) -> float:
        """The share of the run's work done (0 until the run's size is known)."""
        total = self.bar.total
        return (self.steps if self.by_steps else self.samples) / total if total else 0.0

    def now(self) -> float:
        """Seconds on the run's clock (this process's clock before any event had a ``t``)."""
        return self.clock() - (self.lag or 0.0)

    @property
    def seconds(self) -> float:
        """Seconds of training so far (0 before training starts)."""
        return 0.0 if self.started is None else self.now() - self.started

    def due(self) -> list[tuple[int, Change]]:
        """The changes reached since the last call, in order: (node index, change)."""
        reached: list[tuple[int, Change]] = []
        share, seconds = self.share, self.seconds
        if self.started is None or self.finished:
            return reached
        for node, changes in enumerate(self.schedules):
            while self.next[node] < len(changes) and changes[self.next[node]].reached(
                share, seconds
            ):
                reached.append((node, changes[self.next[node]]))
                self.next[node] += 1
        return reached


class NodeActions(Protocol):
    """What a launcher does to worker node ``index`` when its schedule says so."""

    def set_budget(self, index: int, cores: float) -> None:
        """Rewrite the node's CPU quota (its process keeps running)."""

    def leave(self, index: int) -> None:
        """Kill the node's process (SIGKILL: the node is gone, as after a failure)."""

    def rejoin(self, index: int) -> None:
        """Start the node's process again, under the same name, node and budget."""


class ScheduleRunner:
    """Applies the schedule changes a run reaches, in order, and records each.

    Args:
        follower: which changes are due, from the run's events.
        actions: what is done at a change (a budget rewrite; ``off`` leaves; ``on`` sets the
            budget the node left with and rejoins).
    """

    def __init__(self, follower: ScheduleFollower, actions: NodeActions) -> None:
        self.follower, self.actions = follower, actions
        self.applied: list[dict[str, Any]] = []

    def step(self, records: Iterable[dict[str, Any]]) -> None:
        """Take new events into account, then apply every change now due.

        ``applied`` gets one ``{"node", "change", "cores", "t", "train_t"}`` per change: the
        node's index, the step as written (``off@33.3%``), its budget from then on (None while
        off), the run's clock and the training time when it was applied.
        """
        for record in records:
            self.follower.feed(record)
        for node, change in self.follower.due():
            t, train_t = self.follower.now(), self.follower.seconds
            log.info("node %d: %s at %.1f s of training", node, change.text(), train_t)
            if change.action == OFF:
                self.actions.leave(node)
            else:
                assert change.cores is not None
                self.actions.set_budget(node, change.cores)
                if change.action == ON:
                    self.actions.rejoin(node)
            record = {"node": node, "change": change.text(), "cores": change.cores}
            self.applied.append({**record, "t": round(t, 3), "train_t": round(train_t, 3)})
