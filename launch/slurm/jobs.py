"""Runs as Slurm jobs for ``pslaunch compare --launcher slurm``: build, submit, wait, read."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import need
from common.errors import PSError
from launch.settings import TrainSettings
from launch.slurm.config import DDP, SlurmJob, time_limit_s
from launch.slurm.groups import Group
from launch.slurm.submit import (
    check_run_dir,
    read_summary,
    slurm_command,
    submit,
    wait_job,
    write_script,
)

log = logging.getLogger(__name__)

LAUNCHERS = ("local", "slurm")


@dataclasses.dataclass(frozen=True)
class SlurmRuns:
    """How each run of a comparison becomes a Slurm job.

    Attributes:
        partition: Slurm partition (None: the cluster's default).
        time: each job's time limit, in Slurm's format.
        wait_timeout_s: how long to wait for one job, queueing included; a job still
            unfinished then is cancelled and recorded as failed.
        python: the Python with rs-pserver installed, as the nodes see it.
        sbatch_options: further ``#SBATCH`` options for every job.
    """

    partition: str | None = None
    time: str = "01:00:00"
    wait_timeout_s: float = 86400.0
    python: str = sys.executable
    sbatch_options: tuple[str, ...] = ()

    def validate(self) -> SlurmRuns:
        """Check the fields.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        time_limit_s(self.time)
        need(self.wait_timeout_s > 0, f"--wait-timeout must be > 0, got {self.wait_timeout_s}")
        return self

    def job(
        self,
        *,
        dataset: Path,
        model: str,
        mode: str,
        run_dir: Path,
        slowdowns: tuple[float, ...],
        train: TrainSettings,
        cpus: int,
        server_options: tuple[str, ...] = (),
        worker_options: tuple[str, ...] = (),
    ) -> SlurmJob:
        """One run as a plain job: a server and one worker task per slowdown, or DDP ranks.

        Args:
            dataset, model: as for ``pserver start``.
            mode: a server mode, or ``ddp``.
            run_dir: the run's directory.
            slowdowns: one per worker (or rank).
            train: the training settings every run shares.
            cpus: CPUs (and torch threads) per worker or rank.
            server_options: further ``pserver start`` options (server modes only).
            worker_options: further ``worker join`` options (server modes only).

        Returns:
            The validated job. The time-limit warning comes a third of the limit (at most
            180 s) before its end, so short test limits still leave time to train.

        Raises:
            ConfigError: the job is invalid.
        """
        limit = time_limit_s(self.time)
        return SlurmJob(
            dataset=dataset.resolve(),
            model=model,
            mode=mode,
            run_dir=run_dir.resolve(),
            groups=(Group(name="workers", slowdowns=slowdowns, cpus=cpus),),
            train=train,
            server_options=server_options if mode != DDP else (),
            worker_options=worker_options if mode != DDP else (),
            partition=self.partition,
            time=self.time,
            signal_before_s=min(180, limit // 3),
            python=self.python,
            job_name=f"rs-compare-{mode}",
            sbatch_options=self.sbatch_options,
        ).validate()


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
