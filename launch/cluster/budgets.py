"""CPU budgets of emulated nodes: one CPU-quota control group per process, under one parent
group ``pslaunch-<pid>`` that is removed with everything in it when the run ends.

cgroup v2 (``cpu.max``) is used where the unified hierarchy has the cpu controller, else v1
(``cpu.cfs_quota_us``/``cpu.cfs_period_us``). The period is short (``PERIOD_US``), so a step
of a few milliseconds is slowed evenly rather than run in 100 ms bursts; a budget too small for
the kernel's 1 ms minimum quota at that period gets a longer period. The parent group's weight
(v1 ``cpu.shares``, v2 ``cpu.weight``) is raised, so other load on the machine takes less of
the nodes' budgets: a quota caps a node's CPU, it cannot reserve it.

A child enters its group before it executes its command (``wrap``), so none of its threads
ever runs outside the budget.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
from pathlib import Path

from common.config import need
from common.cpu_quota import CpuHierarchy, find_cpu_hierarchy
from common.errors import ConfigError, PSError, WaitTimeout
from common.polling import poll_until

log = logging.getLogger(__name__)

PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota (v1 and v2)
PARENT_SHARES = 8192  # v1 cpu.shares of the parent group (the default is 1024)
PARENT_WEIGHT = 800  # v2 cpu.weight of the parent group (the default is 100)
EMPTY_TIMEOUT_S = 5.0  # how long a group's killed processes may take to leave it
PREFIX = "pslaunch-"


def quota_period_us(cores: float) -> tuple[int, int]:
    """The (quota, period) in microseconds of a budget of ``cores``: ``PERIOD_US`` unless the
    quota would fall below the kernel's minimum, then the shortest period that allows it."""
    period = PERIOD_US
    if cores * period < MIN_QUOTA_US:
        period = math.ceil(MIN_QUOTA_US / cores)
    return max(round(cores * period), MIN_QUOTA_US), period


def usable_cores() -> int:
    """The cores this process may run on."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_total(budgets: list[float], allow_oversubscribe: bool) -> None:
    """Refuse budgets that sum to more cores than the machine has.

    Raises:
        ConfigError: the sum exceeds the usable cores and ``allow_oversubscribe`` is False.
    """
    total, cores = sum(budgets), usable_cores()
    if total > cores + 1e-9 and not allow_oversubscribe:
        raise ConfigError(
            f"the CPU budgets sum to {total:g} cores but this machine has {cores}: the emulated "
            "nodes would compete for cores again (lower them, or pass --allow-oversubscribe)"
        )


def require_hierarchy() -> CpuHierarchy:
    """The cpu controller's hierarchy, where this process may create groups.

    Raises:
        ConfigError: there is no cpu controller, or this process is not root.
    """
    hierarchy = find_cpu_hierarchy()
    if hierarchy is None:
        raise ConfigError(
            "CPU budgets need the cgroup cpu controller, which this system does not mount "
            "(neither cgroup v2 with cpu nor a v1 cpu hierarchy)"
        )
    need(os.geteuid() == 0, "CPU budgets need root (they create control groups); run as root")
    return hierarchy


class CpuBudgets:
    """The control groups of one launch, created on demand and removed by ``close``.

    Args:
        hierarchy: where the cpu controller is mounted (``require_hierarchy``).
        tag: what makes the parent group's name unique (default: this process's pid).
    """

    def __init__(self, hierarchy: CpuHierarchy, tag: str | None = None) -> None:
        self.hierarchy = hierarchy
        self.parent = hierarchy.mount / f"{PREFIX}{tag or os.getpid()}"
        self.groups: list[Path] = []

    def _write(self, path: Path, value: str) -> None:
        try:
            path.write_text(value)
        except OSError as exc:
            raise PSError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc

    def _ensure_parent(self) -> None:
        if self.parent.is_dir():
            return
        if self.hierarchy.version == 2:
            controllers = (self.hierarchy.mount / "cgroup.subtree_control").read_text().split()
            if "cpu" not in controllers:
                self._write(self.hierarchy.mount / "cgroup.subtree_control", "+cpu")
        try:
            self.parent.mkdir()
        except OSError as exc:
            raise PSError(f"cannot create the control group {self.parent}: {exc}") from exc
        if self.hierarchy.version == 2:
            self._write(self.parent / "cgroup.subtree_control", "+cpu")
            with contextlib.suppress(PSError):
                self._write(self.parent / "cpu.weight", str(PARENT_WEIGHT))
        else:
            with contextlib.suppress(PSError):
                self._write(self.parent / "cpu.shares", str(PARENT_SHARES))

    def group(self, name: str, cores: float) -> Path:
        """Create the group ``name`` with a budget of ``cores``.

        Returns:
            The group's directory (give it to ``wrap``).

        Raises:
            PSError: the group cannot be created or its quota set.
        """
        self._ensure_parent()
        path = self.parent / name
        path.mkdir()
        self.groups.append(path)
        self.set_quota(path, cores)
        return path

    def set_quota(self, group: Path, cores: float) -> None:
        """Give ``group`` a budget of ``cores`` (at creation, or while its process runs).

        Raises:
            PSError: the quota cannot be written.
        """
        quota, period = quota_period_us(cores)
        if self.hierarchy.version == 2:
            self._write(group / "cpu.max", f"{quota} {period}")
        else:
            self._write(group / "cpu.cfs_period_us", str(period))
            self._write(group / "cpu.cfs_quota_us", str(quota))
        log.debug("control group %s: %d us per %d us", group, quota, period)

    @staticmethod
    def wrap(group: Path, command: list[str]) -> list[str]:
        """``command`` run from inside ``group``: a shell writes its own pid into the group,
        then becomes the command (``exec`` keeps the pid), so nothing runs outside it.

        Keep this the outermost wrapper: what the command then enters (a network namespace)
        may hide the cgroup file system.
        """
        script = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
        return ["/bin/sh", "-c", script, "pslaunch-enter", str(group), *command]

    def close(self) -> None:
        """Kill whatever still runs in the groups and remove them and the parent."""
        for path in reversed(self.groups):
            _empty(path)
            with contextlib.suppress(FileNotFoundError):
                _rmdir(path)
        self.groups.clear()
        if self.parent.is_dir():
            _rmdir(self.parent)


def _pids(group: Path) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    return []


def _empty(group: Path) -> None:
    """SIGKILL every process left in ``group`` (all started by this launch) and wait until
    the kernel has taken them out."""

    def emptied() -> bool:
        pids = _pids(group)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    try:
        poll_until(emptied, EMPTY_TIMEOUT_S, 0.02, f"{group} to empty")
    except WaitTimeout:
        log.warning("processes %s did not leave %s", _pids(group), group)


def _rmdir(path: Path) -> None:
    """Remove an empty group (a just-reaped process may hold it a moment longer)."""
    errors: list[OSError] = []

    def removed() -> bool:
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(exc)
            return False
        return True

    try:
        poll_until(removed, EMPTY_TIMEOUT_S, 0.02, f"{path} to be removed")
    except WaitTimeout:
        log.warning("cannot remove the control group %s: %s", path, errors[-1])
