"""``pslaunch slurm``: write a Slurm job script for a training run, and submit it."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from common.errors import ConfigError, PSError
from common.logsetup import setup_logging
from common.training.tables import summary_tables
from launch.cli_options import async_options, build_train, extra_options, train_options
from launch.settings import server_mode_args
from launch.slowdowns import parse_slowdowns
from launch.slurm.config import DDP, SlurmJob
from launch.slurm.groups import HET_HELP, Group, parse_het, spread_shards
from launch.slurm.submit import check_run_dir, read_summary, wait_job, write_script
from launch.slurm.submit import submit as submit_job
from pserver.config import MODES


def _groups(
    het: str | None,
    workers: int | None,
    slowdowns: str,
    nodes: int | None,
    cpus: int,
    gpus: int,
    shards: int,
) -> tuple[Any, tuple[Group, ...]]:
    """The server component and worker groups from the command line."""
    if het:
        if slowdowns != "1" or nodes is not None:
            raise ConfigError("with --het, give slowdown= and nodes= per component")
        server, groups = parse_het(het)
        total = sum(g.workers for g in groups)
        if workers is not None and workers != total:
            raise ConfigError(f"--workers {workers} but the --het components hold {total}")
        return server, spread_shards(groups, shards)
    group = Group(
        name="workers",
        slowdowns=parse_slowdowns(slowdowns, workers),
        cpus=cpus,
        nodes=nodes,
        gpus_per_worker=gpus,
        shards=shards,
    )
    return None, (group.validate(),)


@click.command()
@click.option(
    "--dataset",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="HDF5 dataset made by 'pserver data', at a path every node sees.",
)
@click.option("--model", required=True, help="Built-in model name or package.module:factory.")
@click.option(
    "--mode",
    type=click.Choice((*MODES, DDP)),
    default="weighted-sync",
    help="Server mode, or ddp: the torch DDP baseline, one srun task per rank (workers, "
    "slowdowns, nodes, partition and CPUs as for workers).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Workers (default: one per --slowdowns entry).",
)
@click.option(
    "--slowdowns",
    default="1",
    help="Comma-separated emulated slowdown per worker; a single value applies to all.",
)
@click.option("--nodes", type=int, default=None, help="Nodes for the workers (default: Slurm's).")
@click.option("--partition", default=None, help="Slurm partition (default: the cluster's).")
@click.option("--cpus-per-worker", type=int, default=1, help="CPUs (and torch threads) per worker.")
@click.option(
    "--gpus-per-worker",
    type=int,
    default=0,
    help="GPUs per worker (--gpus-per-task); a worker uses the first GPU it sees.",
)
@click.option(
    "--shards",
    type=int,
    default=0,
    help="Parameter shard servers ('pserver shard'), placed on the workers' nodes one per node "
    "first; 0 keeps the parameters in the server. With --het: spread over the components "
    "unless they say shards=.",
)
@click.option("--het", default=None, help=HET_HELP)
@click.option("--time", default="01:00:00", help="The job's time limit.")
@click.option(
    "--signal-before",
    type=int,
    default=180,
    help="Seconds before the time limit at which the server is told to stop (--signal=B:TERM@N); "
    "it needs them for its checkpoint, final evaluation and summary.",
)
@click.option(
    "--requeue/--no-requeue",
    default=True,
    help="Requeue the job after the time-limit warning; the next run resumes.",
)
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Run directory on a file system every node sees; job.sbatch is written there.",
)
@click.option("--submit", is_flag=True, help="Submit the job with sbatch.")
@click.option("--wait", is_flag=True, help="Submit, wait for the job to end and print the summary.")
@click.option(
    "--wait-timeout",
    type=float,
    default=86400.0,
    help="With --wait: stop waiting after this many seconds (the job goes on).",
)
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir from its checkpoint.")
@click.option(
    "--python",
    default=sys.executable,
    show_default="this Python",
    help="Python with rs-pserver installed, at a path every node sees.",
)
@click.option("--job-name", default="rs-pserver", help="Slurm job name.")
@click.option(
    "--startup-timeout",
    type=float,
    default=300.0,
    help="Seconds the server may take to listen (also the workers' connect timeout).",
)
@click.option(
    "--stop-timeout",
    type=float,
    default=60.0,
    help="Seconds the workers may take to leave after the server has ended.",
)
@click.option(
    "--sbatch-opt",
    multiple=True,
    help="Extra #SBATCH option, e.g. --sbatch-opt=--account=proj1.",
)
@train_options
@click.option("--target-oa", type=float, default=None, help="Stop at this test OA.")
@async_options
@extra_options
def slurm(
    het: str | None,
    workers: int | None,
    slowdowns: str,
    nodes: int | None,
    cpus_per_worker: int,
    gpus_per_worker: int,
    shards: int,
    submit: bool,
    wait: bool,
    wait_timeout: float,
    target_oa: float | None,
    **options: Any,
) -> None:
    """Write RUN_DIR/job.sbatch for a training run on Slurm; --submit or --wait submits it.

    The server runs on the job's first node, the workers as srun steps (one task each);
    --het makes a heterogeneous job with one component per worker group. --mode ddp writes a
    job of torch DDP ranks instead, one srun task per rank (task 0 hosts the rendezvous).
    """
    setup_logging("INFO", "pslaunch ")
    try:
        train = build_train(options, target_oa)
        server, groups = _groups(
            het, workers, slowdowns, nodes, cpus_per_worker, gpus_per_worker, shards
        )
        mode_args = server_mode_args(options.pop("staleness"), options.pop("max_staleness"))
        seconds = ("signal_before", "startup_timeout", "stop_timeout")
        job = SlurmJob(
            dataset=options.pop("dataset").resolve(),
            run_dir=options.pop("run_dir").resolve(),
            groups=groups,
            train=train,
            het=het is not None,
            server=server,
            server_options=(*mode_args, *options.pop("server_opt")),
            worker_options=options.pop("worker_opt"),
            sbatch_options=options.pop("sbatch_opt"),
            **{f"{key}_s": options.pop(key) for key in seconds},
            **options,  # model, mode, partition, time, requeue, resume, python, job_name
        ).validate()
        if submit or wait:
            check_run_dir(job.run_dir, job.resume)
        script = write_script(job, shlex.join(["pslaunch", *sys.argv[1:]]))
        click.echo(f"pslaunch: wrote {script}")
        if not (submit or wait):
            click.echo(f"pslaunch: submit it with: sbatch {script}")
            return
        job_id = submit_job(script)
        click.echo(
            f"pslaunch: submitted job {job_id} ({job.workers} workers); "
            f"job log {job.run_dir}/slurm-{job_id}.out"
        )
        if not wait:
            return
        try:
            end = wait_job(job_id, wait_timeout)
        except KeyboardInterrupt:
            click.echo(f"pslaunch: stopped waiting; job {job_id} goes on", err=True)
            sys.exit(130)
        click.echo(f"pslaunch: job {job_id} ended: {end.state}, exit code {end.exit_code}")
        try:
            click.echo(summary_tables(read_summary(job.run_dir)))
        except PSError as exc:
            raise PSError(f"job {job_id}: {exc}") from exc
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    if not end.ok:
        raise click.ClickException(f"job {job_id} did not complete; see {job.run_dir}")
