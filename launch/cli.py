"""``pslaunch``: local heterogeneous clusters, the DDP baseline, and comparisons of the modes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.errors import ConfigError, PSError
from common.logsetup import setup_logging
from launch.cli_options import build_train, build_workers, cluster_options, train_options
from launch.compare import MODES_HELP, CompareConfig, run_compare
from launch.ddp.launcher import BACKENDS, DDPConfig, run_ddp
from launch.local import LocalCluster, run_local
from launch.slowdowns import SCHEDULES_HELP, parse_schedules
from launch.slurm.cli import slurm
from launch.slurm.jobs import LAUNCHERS, SlurmRuns
from launch.table import summary_tables
from pserver.config import MODES, STALENESS


def parse_floats(text: str) -> tuple[float, ...]:
    """``"1,2,4"`` -> ``(1.0, 2.0, 4.0)``.

    Raises:
        click.BadParameter: an entry is not a number.
    """
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers") from exc


@click.group(context_settings={"auto_envvar_prefix": "PSLAUNCH", "show_default": True})
def main() -> None:
    """Launch local parameter-server clusters."""


@main.command()
@click.option(
    "--dataset",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="HDF5 dataset made by 'pserver data'.",
)
@click.option("--model", required=True, help="Built-in model name or package.module:factory.")
@click.option("--mode", type=click.Choice(MODES), default="weighted-sync", help="Server mode.")
@click.option(
    "--workers",
    type=int,
    default=None,
    help="Number of workers (default: one per --slowdowns entry).",
)
@click.option(
    "--slowdowns",
    default="1",
    help="Comma-separated slowdown per worker; a single value applies to all.",
)
@click.option("--slowdown-schedules", default="", help=SCHEDULES_HELP)
@click.option("--devices", default="cpu", help="Comma-separated device per worker, or one for all.")
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for metrics.jsonl, summary.json and cluster.log.",
)
@click.option("--epochs", type=int, default=None, help="Stop after this many epochs.")
@click.option("--max-steps", type=int, default=None, help="Stop after this many updates.")
@click.option("--target-oa", type=float, default=None, help="Stop at this test OA.")
@click.option("--global-batch", type=int, default=None, help="Global batch (server default).")
@click.option("--lr", type=float, default=None, help="Learning rate (server default).")
@click.option("--optimizer", default=None, help="sgd or adam (server default).")
@click.option(
    "--staleness",
    type=click.Choice(STALENESS),
    default=None,
    help="Async staleness function (server default).",
)
@click.option("--max-staleness", type=int, default=None, help="Async staleness bound.")
@click.option("--seed", type=int, default=None, help="Seed (server default).")
@click.option(
    "--server-opt",
    "server_opts",
    multiple=True,
    help="Extra 'pserver start' option, e.g. --server-opt=--lr-schedule=cosine.",
)
def local(
    dataset: Path,
    model: str,
    mode: str,
    workers: int | None,
    slowdowns: str,
    slowdown_schedules: str,
    devices: str,
    run_dir: Path,
    server_opts: tuple[str, ...],
    **server: object,
) -> None:
    """Run a server and N local workers with the given slowdowns, then print the summary."""
    setup_logging("INFO", "pslaunch ")
    factors = parse_floats(slowdowns)
    count = workers or len(factors)
    if len(factors) == 1:
        factors = factors * count
    if len(factors) != count:
        raise click.BadParameter(f"--slowdowns has {len(factors)} entries for {count} workers")
    try:
        schedules = parse_schedules(slowdown_schedules, factors)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    options: list[str] = []
    for key, value in server.items():
        if value is not None:
            options += [f"--{key.replace('_', '-')}", str(value)]
    cluster = LocalCluster(
        dataset=dataset,
        model=model,
        mode=mode,
        slowdowns=factors,
        run_dir=run_dir,
        server_options=(*options, *server_opts),
        devices=tuple(d.strip() for d in devices.split(",")),
        slowdown_schedules=schedules,
    )
    click.echo(
        f"pslaunch: {mode} with {count} workers (slowdowns {list(factors)}); "
        f"logs in {run_dir / 'cluster.log'}"
    )
    try:
        summary = run_local(cluster)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        click.echo("pslaunch: interrupted; the cluster was stopped", err=True)
        sys.exit(130)
    click.echo(summary_tables(summary))


@main.command()
@cluster_options
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for metrics.jsonl, summary.json and cluster.log.",
)
@train_options
@click.option("--target-oa", type=float, default=None, help="Stop at this test OA.")
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    help="torch.distributed backend; auto: nccl when every rank is on CUDA, else gloo.",
)
@click.option("--threads", type=int, default=1, help="Torch CPU threads per rank.")
@click.option("--eval-batch", type=int, default=512, help="Evaluation batch on rank 0.")
@click.option(
    "--snapshot-every-steps",
    type=int,
    default=None,
    help="Rank 0 saves every N-th step's state to RUN_DIR/snapshots for 'pserver "
    "evaluate-snapshots' (off by default).",
)
def ddp(
    workers: int | None,
    slowdowns: str,
    slowdown_schedules: str,
    devices: str,
    target_oa: float | None,
    **options: Any,
) -> None:
    """Run the torch.distributed DDP baseline (one process per rank) and print the summary.

    Same data, split, model initialisation, global batch, optimizer, schedule and slowdowns as
    the parameter server; each rank computes B/N samples per step; the slowdown scales compute
    time only; rank 0 evaluates after every epoch.
    """
    setup_logging("INFO", "pslaunch ")
    train = build_train(options, target_oa)
    factors, schedules, device_list = build_workers(workers, slowdowns, slowdown_schedules, devices)
    config = DDPConfig(
        train=train,
        slowdowns=factors,
        slowdown_schedules=schedules,
        devices=device_list,
        **options,
    )
    click.echo(
        f"pslaunch: ddp with {len(factors)} ranks (slowdowns {list(factors)}); "
        f"logs in {config.run_dir / 'cluster.log'}"
    )
    click.echo(summary_tables(_run(run_ddp, config)))


@main.command()
@cluster_options
@click.option("--modes", default="weighted-sync,equal-sync,async,ddp", help=MODES_HELP)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output directory: compare.json, report.md, report.png and runs/<mode>-<repeat>/.",
)
@train_options
@click.option("--repeats", type=int, default=1, help="Runs per mode (same seeds).")
@click.option(
    "--target-oa",
    type=float,
    default=None,
    help="Report the training time to reach this test OA (runs are not stopped at it).",
)
@click.option(
    "--staleness",
    type=click.Choice(STALENESS),
    default=None,
    help="Async staleness function (server default).",
)
@click.option("--max-staleness", type=int, default=None, help="Async staleness bound.")
@click.option("--threads", type=int, default=1, help="Torch CPU threads per worker and rank.")
@click.option(
    "--server-opt",
    "server_opts",
    multiple=True,
    help="Extra 'pserver start' option for the PS modes, e.g. --server-opt=--staleness-a=1.",
)
@click.option("--progress/--no-progress", default=True, help="Show the live progress line.")
@click.option(
    "--snapshot-every",
    type=int,
    default=None,
    help="Snapshot every N updates (async: every N x workers pushes, about as many samples) "
    "and take time to target from the snapshots, scored after each run (off by default).",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default="local",
    help="local: processes on this machine; slurm: each run as a Slurm job, one at a time.",
)
@click.option("--partition", default=None, help="Slurm partition (default: the cluster's).")
@click.option("--time", "slurm_time", default="01:00:00", help="Each Slurm job's time limit.")
@click.option(
    "--wait-timeout",
    type=float,
    default=86400.0,
    help="Seconds to wait for one Slurm job, queueing included; then it is cancelled.",
)
def compare(
    workers: int | None,
    slowdowns: str,
    slowdown_schedules: str,
    devices: str,
    modes: str,
    server_opts: tuple[str, ...],
    progress: bool,
    partition: str | None,
    slurm_time: str,
    wait_timeout: float,
    **options: Any,
) -> None:
    """Run every mode REPEATS times on the same data, seeds and slowdowns; write a report."""
    setup_logging("WARNING", "pslaunch ")
    if options["epochs"] is None and options["max_steps"] is None:
        options["epochs"] = 5
    train = build_train(options)
    factors, schedules, device_list = build_workers(workers, slowdowns, slowdown_schedules, devices)
    config = CompareConfig(
        train=train,
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
        slowdowns=factors,
        slowdown_schedules=schedules,
        devices=device_list,
        server_options=server_opts,
        slurm=SlurmRuns(partition=partition, time=slurm_time, wait_timeout_s=wait_timeout),
        **options,
    )
    data = _run(lambda c: run_compare(c, show_progress=progress), config)
    click.echo((config.out / "report.md").read_text(encoding="utf-8"))
    failed = [f"{r['mode']} #{r['repeat']}" for r in data["runs"] if "error" in r]
    if failed:
        raise click.ClickException(f"runs failed: {', '.join(failed)}; see their cluster.log")


def _run(runner: Callable[[Any], dict[str, Any]], config: Any) -> dict[str, Any]:
    """Run ``runner(config)``, turning project errors and Ctrl-C into CLI exits."""
    try:
        return runner(config)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        click.echo("pslaunch: interrupted; the processes were stopped", err=True)
        sys.exit(130)


main.add_command(slurm)

if __name__ == "__main__":
    sys.exit(main())
