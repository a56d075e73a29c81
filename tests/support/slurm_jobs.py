"""Helpers for tests that run real Slurm jobs: whether the testbed is up, launch, wait for
events, cancel, show logs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.errors import WaitTimeout
from common.polling import poll_until
from tests.support.paths import ROOT

JOB_TIMEOUT_S = 300.0
TESTBED = ROOT / "launch/slurm/testbed.sh"
TESTBED_MARK = "# rs-pserver Slurm testbed"
SLURM_CONF = Path("/etc/slurm/slurm.conf")


def testbed_problem() -> str | None:
    """Why the project's Slurm testbed is not usable here, or None when it is up.

    It only looks: ``make slurm-testbed`` (as root) installs and starts the testbed.
    """
    if SLURM_CONF.is_file() and not SLURM_CONF.read_text(encoding="utf-8").startswith(TESTBED_MARK):
        return f"{SLURM_CONF} belongs to another Slurm, not the project's testbed"
    if shutil.which("sinfo") is None:
        return "Slurm is not installed ('make slurm-testbed' installs and starts the testbed)"
    try:
        up = subprocess.run(
            ["bash", str(TESTBED), "status"], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "launch/slurm/testbed.sh status took more than 60 s"
    if up.returncode != 0:
        return "the Slurm testbed is down ('make slurm-testbed' starts it)"
    return None


def pslaunch(
    *args: str, timeout: float = JOB_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``pslaunch ARGS`` (with ``env`` added to the environment) and return its result."""
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def job_id_of(output: str) -> str:
    """The job id from pslaunch's 'submitted job N' line."""
    for line in output.splitlines():
        if "submitted job " in line:
            return line.split("submitted job ", 1)[1].split()[0]
    raise AssertionError(f"no 'submitted job' line in:\n{output}")


def logs(run_dir: Path, tail: int = 60) -> str:
    """The job's own output and the last lines of its server, worker and rank logs (also of
    the jobs in ``run_dir/runs/*``, where compare puts them)."""
    parts = []
    for pattern in ("slurm-*.out", "server-*.log", "workers-*.log", "ranks-*.log"):
        for path in sorted([*run_dir.glob(pattern), *run_dir.glob(f"runs/*/{pattern}")]):
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()[-tail:]
            parts.append(f"----- {path.name}\n" + "\n".join(lines))
    return "\n".join(parts) or f"(no logs in {run_dir})"


@contextlib.contextmanager
def jobs_shown_and_cancelled(run_dir: Path, jobs: list[str]) -> Iterator[None]:
    """On failure print the run's logs; always cancel the listed jobs that still run."""
    try:
        yield
    except BaseException:
        print(logs(run_dir))
        raise
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The complete lines of ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def wait_for_event(
    run_dir: Path, name: str, after: str | None = None, timeout: float = JOB_TIMEOUT_S
) -> dict[str, Any]:
    """Block until ``metrics.jsonl`` holds an event ``name`` (after the last event ``after``,
    when given); the file is re-read every 0.2 s."""

    def first() -> dict[str, Any] | None:
        records = events(run_dir)
        if after is not None:
            marks = [i for i, e in enumerate(records) if e.get("event") == after]
            records = records[marks[-1] + 1 :] if marks else []
        return next((e for e in records if e.get("event") == name), None)

    try:
        return poll_until(first, timeout, 0.2, f"a {name!r} event in {run_dir}")
    except WaitTimeout:
        raise AssertionError(
            f"no {name!r} event in {run_dir} within {timeout} s\n{logs(run_dir)}"
        ) from None


def scontrol_job(job: str) -> str:
    """``scontrol show job --oneliner`` of a job ('' when Slurm no longer knows it)."""
    done = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True, timeout=30
    )
    return done.stdout if done.returncode == 0 else ""


def wait_for_state(job: str, text: str, timeout: float = JOB_TIMEOUT_S) -> str:
    """Block until the job's scontrol record contains ``text`` (asked every 0.5 s)."""

    def record() -> str | None:
        found = scontrol_job(job)
        return found if text in found else None

    try:
        return poll_until(record, timeout, 0.5, f"job {job} to show {text!r}")
    except WaitTimeout:
        raise AssertionError(
            f"job {job} never showed {text!r}; last: {scontrol_job(job)}"
        ) from None


def summary(run_dir: Path) -> dict[str, Any]:
    """The run's ``summary.json``."""
    return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
