"""What ``pslaunch slurm`` writes into a job script, and how comparison runs become such jobs."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from common.config import escape_control, need
from common.errors import ConfigError
from launch.ddp.config import DDPConfig
from launch.settings import TrainSettings
from launch.slurm.groups import Group, ServerPlace

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+@,=:-]+$")
DDP = "ddp"
LAUNCHERS = ("local", "slurm")


def time_limit_s(text: str) -> int:
    """Seconds in a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``).

    Args:
        text: the ``--time`` value.

    Returns:
        The limit in seconds.

    Raises:
        ConfigError: the text is not one of Slurm's time formats.
    """
    match = _TIME.match(text.strip())
    if not match:
        raise ConfigError(f"--time {text!r} is not a Slurm time (e.g. 30, 1:00:00, 2-00:00:00)")
    days, a, b, c = match.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = [*parts, 0, 0][:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:  # minutes
        return parts[0] * 60
    if len(parts) == 2:  # minutes:seconds
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """A parameter-server training run as one Slurm job.

    Attributes:
        dataset, model, mode: as for ``pserver start`` (the dataset path as seen on the nodes);
            mode ``ddp`` runs the torch DDP baseline instead, one srun task per rank.
        run_dir: the run directory, on a file system every node of the job sees.
        groups: the workers: one group for a plain job, one per component for a hetjob.
        het: write a heterogeneous job (one component per group, plus ``server`` if given).
        server: the hetjob's own server component (None: the server runs on the job's first
            node, next to the first group's workers).
        train: the training settings passed to the server.
        server_options: further ``pserver start`` options.
        worker_options: further ``worker join`` options.
        partition: the partition of a plain job (None: the cluster's default).
        time: the job's time limit in Slurm's format.
        signal_before_s: Slurm sends TERM to the job script this long before the time limit,
            so the server writes its checkpoint and summary in time.
        requeue: after that warning, requeue the job; the next run resumes.
        resume: continue the run in ``run_dir`` from its newest checkpoint.
        python: the Python interpreter with rs-pserver installed, as seen on the nodes.
        job_name: Slurm's job name.
        startup_timeout_s: how long the job waits for the server to listen.
        stop_timeout_s: how long the job waits for the workers after the server has ended.
        sbatch_options: further ``#SBATCH`` options (for the first component of a hetjob).
    """

    dataset: Path
    model: str
    mode: str
    run_dir: Path
    groups: tuple[Group, ...]
    train: TrainSettings
    het: bool = False
    server: ServerPlace | None = None
    server_options: tuple[str, ...] = ()
    worker_options: tuple[str, ...] = ()
    partition: str | None = None
    time: str = "01:00:00"
    signal_before_s: int = 180
    requeue: bool = True
    resume: bool = False
    python: str = sys.executable
    job_name: str = "rs-pserver"
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    sbatch_options: tuple[str, ...] = ()

    @property
    def workers(self) -> int:
        """All worker tasks of the job."""
        return sum(group.workers for group in self.groups)

    @property
    def shards(self) -> int:
        """Parameter shard servers (0: the server keeps the parameters)."""
        return sum(group.shards for group in self.groups)

    def validate(self) -> SlurmJob:
        """Check the job.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        need(self.groups, "the job has no workers")
        for option, value in self._texts():  # a control character would end a script line
            need(
                escape_control(value) == value,
                f"{option} {value!r}: control characters (newline, carriage return, NUL, tab, "
                "...) cannot go into a job script",
            )
        for group in self.groups:
            group.validate()
        need(
            self.shards != 1,
            "one shard keeps the parameters in the server: give no shards or at least 2",
        )
        if not self.het and (len(self.groups) != 1 or self.server is not None):
            raise ConfigError("a plain job has one worker group and no server component")
        if self.mode == DDP:
            self._validate_ddp()
        limit = time_limit_s(self.time)
        need(limit > 0, f"--time must be positive, got {self.time!r}")
        need(
            0 <= self.signal_before_s <= 65535,
            f"--signal-before must be in [0, 65535] s, got {self.signal_before_s}",
        )
        need(
            self.signal_before_s < limit,
            f"--signal-before {self.signal_before_s} s leaves no time to train within "
            f"--time {self.time}",
        )
        need(
            _SAFE_NAME.match(self.job_name),
            f"--job-name {self.job_name!r}: use letters, digits, '.', '_', '-'",
        )
        for option_name, seconds in (
            ("--startup-timeout", self.startup_timeout_s),
            ("--stop-timeout", self.stop_timeout_s),
        ):
            need(seconds > 0, f"{option_name} must be > 0, got {seconds}")
        for option in self.sbatch_options:
            if not option.startswith("--") or "\n" in option:
                raise ConfigError(f"--sbatch-opt {option!r} must be one '--name[=value]' option")
        for path in (self.dataset, self.run_dir):
            need(path.is_absolute(), f"{path} must be an absolute path in a job script")
        need(
            _SAFE_PATH.match(str(self.run_dir)),
            f"--run-dir {str(self.run_dir)!r}: #SBATCH lines need a path without spaces, "
            "quotes or shell characters",
        )
        return self

    def _texts(self) -> list[tuple[str, str]]:
        """Every text that goes into the job script, with the option it came from."""
        fields = ("dataset", "run_dir", "model", "mode", "partition", "time", "python", "job_name")
        texts = [("--" + f.replace("_", "-"), str(getattr(self, f) or "")) for f in fields]
        for flag, options in (
            ("--sbatch-opt", self.sbatch_options),
            ("--server-opt", (*self.server_options, *self.train.server_args())),
            ("--worker-opt", self.worker_options),
        ):
            texts += [(flag, option) for option in options]
        places: list[Group | ServerPlace] = [*self.groups, *([self.server] if self.server else [])]
        for place in places:
            texts += [("--het", getattr(place, "name", "")), ("--het", place.partition or "")]
            texts.append(("--het", place.constraint or ""))
        return texts

    def _validate_ddp(self) -> None:
        """Refuse what a DDP job cannot do: no server, no shards, no checkpoint to resume."""
        refused = [
            (self.het, "--het"),
            (self.shards > 0, "--shards"),
            (self.resume, "--resume"),
            (bool(self.server_options), "server options"),
            (bool(self.worker_options), "--worker-opt"),
        ]
        for present, name in refused:
            need(not present, f"--mode ddp runs torch DDP ranks: {name} does not apply")
        self.ddp_config().validate()

    def ddp_config(self) -> DDPConfig:
        """The DDP baseline's configuration for this job (mode ``ddp``): one rank per worker
        of the group, its CPUs as torch threads, the job's time limit as the run's bound."""
        group = self.groups[0]
        return DDPConfig(
            dataset=self.dataset,
            model=self.model,
            slowdowns=group.slowdowns,
            run_dir=self.run_dir,
            train=self.train,
            devices=("cuda:0",) if group.gpus else ("cpu",),
            threads=group.cpus,
            startup_timeout_s=self.startup_timeout_s,
            run_timeout_s=float(time_limit_s(self.time)),
        )


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
