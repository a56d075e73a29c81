"""CPU-quota control groups as Linux exposes them: where the ``cpu`` controller is mounted
(cgroup v2's unified hierarchy, else v1's ``cpu`` hierarchy), and the quota this process runs
under.

A process under a CPU quota is slow in wall-clock time while its threads' CPU time runs at the
speed of an unthrottled core (a throttled thread is not running, so its CPU time does not
grow); ``ComputeTimer`` asks ``own_quota_cores`` to know which clock tells its speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
OWN_CGROUP = Path("/proc/self/cgroup")


@dataclasses.dataclass(frozen=True)
class CpuHierarchy:
    """Where the ``cpu`` controller lives.

    Attributes:
        version: 1 (``cpu.cfs_quota_us``/``cpu.cfs_period_us``) or 2 (``cpu.max``).
        mount: the hierarchy's mount point, e.g. ``/sys/fs/cgroup/cpu`` or ``/sys/fs/cgroup``.
        root: the path of the mount's root inside the hierarchy (``/`` outside containers).
    """

    version: int
    mount: Path
    root: str = "/"

    def path_of(self, group: str) -> Path | None:
        """The directory of the group named ``group`` as ``/proc/self/cgroup`` writes it (None
        when it lies outside this mount)."""
        root = self.root.rstrip("/")
        if root and group != root and not group.startswith(root + "/"):
            return None
        return self.mount / group[len(root) :].lstrip("/")


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of every mount in ``mountinfo``."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        tail = line.split(" - ", 1)[1].split()
        if len(tail) < 3:
            continue
        mounts.append((_unescape(fields[3]), _unescape(fields[4]), tail[0], tail[2]))
    return mounts


def _unescape(text: str) -> str:
    """mountinfo writes spaces and the like as octal escapes (``\\040``)."""
    return text.encode().decode("unicode_escape") if "\\" in text else text


def find_cpu_hierarchy(mountinfo: str | None = None) -> CpuHierarchy | None:
    """The hierarchy that has the ``cpu`` controller: v2 where the unified hierarchy enables
    it, else v1's ``cpu`` mount; None when there is neither.

    Args:
        mountinfo: the text of ``/proc/self/mountinfo`` (read when not given).
    """
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text(encoding="utf-8")
        except OSError:
            return None
    mounts = _mounts(mountinfo)
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2":
            with contextlib.suppress(OSError):
                controllers = (Path(point) / "cgroup.controllers").read_text().split()
                if "cpu" in controllers:
                    return CpuHierarchy(2, Path(point), root)
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "cpu" in options.split(","):
            return CpuHierarchy(1, Path(point), root)
    return None


def quota_cores(group_dir: Path, version: int) -> float | None:
    """The CPU quota set on one group directory, in cores (None: no quota or unreadable)."""
    try:
        if version == 2:
            quota, period = (group_dir / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((group_dir / "cpu.cfs_quota_us").read_text())
        period_us = int((group_dir / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us < 0 else quota_us / period_us


@functools.cache
def own_quota_cores() -> float | None:
    """The tightest CPU quota over this process's control group and its ancestors, in cores;
    None when it runs under none (or the system does not say)."""
    hierarchy = find_cpu_hierarchy()
    if hierarchy is None:
        return None
    try:
        lines = OWN_CGROUP.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    group = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (hierarchy.version == 2 and controllers == "") or (
            hierarchy.version == 1 and "cpu" in controllers.split(",")
        ):
            group = path
    directory = None if group is None else hierarchy.path_of(group)
    quotas = []
    while directory is not None:
        quota = quota_cores(directory, hierarchy.version)
        if quota is not None:
            quotas.append(quota)
        if directory == hierarchy.mount:
            break
        directory = directory.parent
    return min(quotas) if quotas else None
