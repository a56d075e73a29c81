"""CPU budgets of emulated nodes: the quota arithmetic, the hierarchy detection, the
oversubscription check, and (as root, with a cpu controller) real control groups: budgets slow a
CPU-bound step in proportion, the planner's speeds follow them, and nothing is left in the
hierarchy or the process table after a normal end, a child's failure or SIGTERM."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from common.cpu_quota import CpuHierarchy, find_cpu_hierarchy, quota_cores
from common.errors import ConfigError
from launch.cli import main
from launch.cluster.budgets import (
    check_total,
    quota_period_us,
    usable_cores,
)

V1_MOUNTINFO = (
    "25 20 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
    "30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "31 25 0:27 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct\n"
)


def test_quota_and_period_keep_the_kernel_minimum() -> None:
    assert quota_period_us(0.4) == (4000, 10000)
    assert quota_period_us(0.1) == (1000, 10000)
    assert quota_period_us(0.05) == (1000, 20000)  # 0.5 ms per 10 ms is below the minimum
    assert quota_period_us(2.0) == (20000, 10000)


def test_hierarchy_detection_prefers_v2_with_cpu_else_v1(tmp_path: Path) -> None:
    assert find_cpu_hierarchy(V1_MOUNTINFO) == CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb pids\n")
    v2 = f"40 25 0:30 / {unified} rw - cgroup2 cgroup2 rw\n"
    assert find_cpu_hierarchy(v2 + V1_MOUNTINFO).version == 1  # v2 without cpu: v1
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    assert find_cpu_hierarchy(v2 + V1_MOUNTINFO) == CpuHierarchy(2, unified)
    assert find_cpu_hierarchy("") is None


def test_quota_files_are_read_in_cores(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("4000 10000\n")
    assert quota_cores(tmp_path, 2) == pytest.approx(0.4)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert quota_cores(tmp_path, 2) is None
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cores(tmp_path, 1) is None
    (tmp_path / "cpu.cfs_quota_us").write_text("1000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("20000\n")
    assert quota_cores(tmp_path, 1) == pytest.approx(0.05)


def test_oversubscribed_budgets_are_refused_unless_allowed() -> None:
    cores = usable_cores()
    with pytest.raises(ConfigError, match=f"sum to {cores + 1:g} cores but this machine has"):
        check_total([cores, 1.0], allow_oversubscribe=False)
    check_total([cores, 1.0], allow_oversubscribe=True)
    check_total([cores / 2, cores / 2], allow_oversubscribe=False)


def test_pslaunch_refuses_oversubscription_in_one_line(small_hsi: Path, tmp_path: Path) -> None:
    per_worker = usable_cores()  # two workers and a server at this budget: 3x the machine
    result = CliRunner().invoke(
        main,
        [
            "local",
            "--dataset",
            str(small_hsi),
            "--model",
            "hsi-cnn",
            "--slowdowns",
            "1,1",
            "--node-cpus",
            str(per_worker),
            "--server-cpus",
            str(per_worker),
            "--epochs",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
        ],
    )
    assert result.exit_code != 0
    message = result.output.strip().splitlines()[-1]
    assert "budgets sum to" in message and "--allow-oversubscribe" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was started
