"""Write ``job.sbatch``, submit it with ``sbatch``, wait for the job to end, or cancel it."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import rundir
from common.errors import ConfigError, NetworkTimeout, PSError, WaitTimeout
from common.polling import poll_until
from launch.slurm.config import SlurmJob
from launch.slurm.script import render

log = logging.getLogger(__name__)


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to start a new run over an old one, or to resume nothing.

    Args:
        run_dir: the run directory.
        resume: the job continues the run from its newest checkpoint.

    Raises:
        ConfigError: ``run_dir`` holds a run and ``resume`` is off, or it has no checkpoint
            and ``resume`` is on.
    """
    if rundir.started(run_dir) and not resume:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(rundir.run_files(run_dir))}); give "
            "--resume to continue it or choose another --run-dir"
        )
    if resume and not any((run_dir / "checkpoints").glob("ckpt-*.npz")):
        raise ConfigError(f"--resume: {run_dir / 'checkpoints'} holds no checkpoint")


def write_script(job: SlurmJob, command: str) -> Path:
    """Write ``run_dir/job.sbatch`` (executable) and return its path."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    path = job.run_dir / "job.sbatch"
    path.write_text(render(job, command, str(path)), encoding="utf-8")
    path.chmod(0o755)
    return path


TERMINAL = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})  # fmt: skip
_STATE = re.compile(r"\bJobState=(\S+)")
_EXIT = re.compile(r"\bExitCode=(\d+):(\d+)")


@dataclasses.dataclass(frozen=True)
class JobEnd:
    """How a job ended.

    Attributes:
        job_id: Slurm's job id.
        state: the final state of its first component (``COMPLETED``, ``FAILED``, ...), or
            ``UNKNOWN`` when Slurm had already forgotten the job.
        exit_code: the job script's exit code (a signal counts as 128 + its number; None when
            unknown).
    """

    job_id: str
    state: str
    exit_code: int | None

    @property
    def ok(self) -> bool:
        """The job completed with exit code 0."""
        return self.state == "COMPLETED" and self.exit_code == 0


def slurm_command(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command with a timeout.

    Raises:
        PSError: the command is not installed.
        NetworkTimeout: it did not answer within ``timeout_s``.
    """
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise PSError(f"{command[0]} not found: is Slurm installed on this machine?") from None
    except subprocess.TimeoutExpired:
        raise NetworkTimeout(f"{' '.join(command)} did not answer in {timeout_s:g} s") from None


def submit(script: Path, timeout_s: float = 60.0) -> str:
    """Submit ``script`` with ``sbatch`` (from its own directory).

    Args:
        script: the job script.
        timeout_s: how long sbatch may take.

    Returns:
        The job id.

    Raises:
        PSError: sbatch is missing or refused the job.
        NetworkTimeout: sbatch did not answer in time.
    """
    if shutil.which("sbatch") is None:
        raise PSError("sbatch not found: submit from a machine where Slurm is installed")
    done = slurm_command(["sbatch", "--parsable", str(script)], timeout_s)
    if done.returncode != 0 or not done.stdout.strip():
        raise PSError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().splitlines()[-1].split(";")[0]


def job_state(job_id: str, timeout_s: float = 30.0) -> tuple[str, int | None] | None:
    """The state and exit code of a job, from ``scontrol show job``.

    A heterogeneous job has ended when every component has; its exit code is the first
    component's (the job script's).

    Args:
        job_id: the job (or heterogeneous job leader) id.
        timeout_s: how long scontrol may take.

    Returns:
        ``(state, exit_code)`` (the state ``RUNNING`` while any component has not ended), or
        None when Slurm no longer knows the job.

    Raises:
        PSError: scontrol failed for another reason.
    """
    done = slurm_command(["scontrol", "show", "job", "--oneliner", job_id], timeout_s)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise PSError(f"scontrol show job {job_id}: {done.stderr.strip()}")
    lines = [line for line in done.stdout.splitlines() if "JobState=" in line]
    states = [m.group(1) for m in (_STATE.search(line) for line in lines) if m]
    if not states:
        return None
    exit_match = _EXIT.search(lines[0])
    code = None
    if exit_match:
        status, signal = int(exit_match.group(1)), int(exit_match.group(2))
        code = 128 + signal if signal else status
    if any(state not in TERMINAL for state in states):
        return "RUNNING" if "RUNNING" in states else states[0], code
    return states[0], code


def wait_job(job_id: str, timeout_s: float, poll_s: float = 2.0) -> JobEnd:
    """Wait for a job to end, requeues included.

    Slurm offers no notification of a job's end to a client (``sbatch --wait`` polls too,
    backing off to 32 s), so this asks ``scontrol`` every ``poll_s`` seconds.

    Args:
        job_id: the job id.
        timeout_s: how long to wait; the job goes on when this runs out.
        poll_s: seconds between questions.

    Returns:
        How it ended.

    Raises:
        NetworkTimeout: the job had not ended within ``timeout_s`` (it goes on).
        PSError: scontrol failed.
    """

    def ended() -> JobEnd | None:
        state = job_state(job_id)
        if state is None:
            return JobEnd(job_id, "UNKNOWN", None)
        return JobEnd(job_id, state[0], state[1]) if state[0] in TERMINAL else None

    try:
        return poll_until(ended, timeout_s, poll_s, f"job {job_id} to end")
    except WaitTimeout as exc:
        raise NetworkTimeout(
            f"job {job_id} had not ended after {timeout_s:g} s; it goes on "
            f"(scancel {job_id} stops it)"
        ) from exc


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run's ``summary.json``.

    Raises:
        PSError: it is missing or not JSON.
    """
    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise PSError(f"the job wrote no readable {path}: {exc}") from exc


def cancel(job_id: str, timeout_s: float = 30.0) -> None:
    """``scancel`` a job; a failure is logged, not raised (the job may have just ended)."""
    try:
        done = slurm_command(["scancel", job_id], timeout_s)
    except (OSError, PSError) as exc:
        log.warning("scancel %s: %s", job_id, exc)
        return
    if done.returncode != 0:
        log.warning("scancel %s: %s", job_id, done.stderr.strip())


def run_job(
    job: SlurmJob,
    command: str,
    wait_timeout_s: float,
    on_submit: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write the job's script, submit it, wait for the job and return the run's summary.

    Args:
        job: the validated job.
        command: the command quoted in the script's header.
        wait_timeout_s: how long to wait, queueing included.
        on_submit: called with the job id once Slurm has accepted the job.

    Returns:
        The run's ``summary.json``.

    Raises:
        ConfigError: the run directory already holds a run.
        PSError: the job was refused, did not complete, or wrote no summary; a job still
            unfinished at the timeout (or on Ctrl-C) is cancelled first.
    """
    check_run_dir(job.run_dir, job.resume)
    script = write_script(job, command)
    job_id = submit(script)
    log.info("submitted job %s (%s) for %s", job_id, job.mode, job.run_dir)
    if on_submit is not None:
        on_submit(job_id)
    try:
        end = wait_job(job_id, wait_timeout_s)
    except BaseException:
        cancel(job_id)
        raise
    if not end.ok:
        raise PSError(
            f"job {job_id} ended {end.state}, exit code {end.exit_code}; see its logs in "
            f"{job.run_dir}"
        )
    return read_summary(job.run_dir)
