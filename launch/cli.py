"""``pslaunch``: local heterogeneous clusters, the DDP baseline, and comparisons of the modes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.cli_env import show_envvars
from common.cli_help import FullHelpGroup
from common.errors import ConfigError, PSError
from common.logsetup import setup_logging
from common.training.tables import files_written, summary_tables
from launch.cli_options import (
    async_options,
    budget_options,
    build_cluster,
    build_train,
    checkpoint_option,
    cluster_options,
    folder_options,
    link_options,
    progress_option,
    run_options,
    threads_option,
    train_options,
    warn_unbudgeted_server,
)
from launch.compare import MODES_HELP, CompareConfig, run_compare
from launch.ddp.config import BACKENDS, GRAD_COMPRESSION, REBALANCE, DDPConfig
from launch.ddp.launcher import run_ddp
from launch.local import LocalCluster, run_local
from launch.progress import RunProgress
from launch.settings import TrainSettings, server_mode_args
from launch.simulate.cli import simulate
from launch.slurm.cli import slurm
from launch.slurm.config import LAUNCHERS, SlurmRuns
from pserver.config import MODES

run_dir_option = click.option(  # local and ddp
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for metrics.jsonl, summary.json and cluster.log.",
)


@click.group(
    cls=FullHelpGroup, context_settings={"auto_envvar_prefix": "PSLAUNCH", "show_default": True}
)
def main() -> None:
    """Launch local parameter-server clusters."""


@main.command()
@cluster_options
@click.option("--mode", type=click.Choice(MODES), default="weighted-sync", help="Server mode.")
@run_dir_option
@train_options
@click.option("--target-oa", type=float, default=None, help="Stop at this test OA.")
@async_options
@run_options
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    default=1,
    help="Parameter shards: K > 1 starts K 'pserver shard' processes beside the server, each "
    "holding 1/K of the state; 1 keeps the parameters in the server.",
)
@link_options
@budget_options
@folder_options
def local(progress: bool, **params: Any) -> None:
    """Run a server, its shards and N local workers with the given slowdowns, then print the
    summary."""
    setup_logging("INFO", "pslaunch ")
    cluster, train = local_cluster(**params)
    _run(lambda c: c.check().close(), cluster)  # a refusal before any output or file
    warn_unbudgeted_server(cluster.nodes)
    click.echo(
        f"pslaunch: {cluster.mode} with {len(cluster.slowdowns)} workers "
        f"(slowdowns {list(cluster.slowdowns)})"
        + (f" and {cluster.shards} shards" if cluster.shards > 1 else "")
        + (f" on {cluster.nodes.summary_line()}" if cluster.nodes else "")
        + f"; logs in {cluster.run_dir / 'cluster.log'}"
    )
    bar = RunProgress(train.epochs, train.max_steps, enabled=progress)
    summary = _run(lambda c: run_local(c, progress=bar), cluster)
    click.echo(summary_tables(summary))
    click.echo(f"summary: {cluster.run_dir / 'summary.json'}")


def local_cluster(
    target_oa: float | None,
    staleness: str | None,
    max_staleness: int | None,
    threads: int,
    server_opt: tuple[str, ...],
    worker_opt: tuple[str, ...] = (),
    **options: Any,
) -> tuple[LocalCluster, TrainSettings]:
    """The validated cluster and training settings of ``pslaunch local``'s options (but
    ``--progress``).

    Raises:
        click.BadParameter: an option is out of range or the options disagree.
    """
    train = build_train(options, target_oa)
    cluster = LocalCluster(
        **build_cluster(options),
        server_options=(
            *train.server_args(),
            *server_mode_args(staleness, max_staleness),
            *server_opt,
        ),
        worker_options=("--threads", str(threads), *worker_opt),
        **options,
    )
    try:
        return cluster.validate(), train
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


@main.command()
@cluster_options
@run_dir_option
@train_options
@click.option("--target-oa", type=float, default=None, help="Stop at this test OA.")
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    help="torch.distributed backend; auto: nccl when every rank is on CUDA, else gloo.",
)
@threads_option
@click.option("--eval-batch", type=int, default=512, help="Evaluation batch on rank 0.")
@click.option(
    "--snapshot-every-steps",
    type=int,
    default=None,
    help="Rank 0 saves every N-th step's state to RUN_DIR/snapshots for 'pserver "
    "evaluate-snapshots' (off by default).",
)
@click.option(
    "--grad-compression",
    type=click.Choice(GRAD_COMPRESSION),
    default="none",
    help="bf16: gradients travel as bfloat16 through PyTorch's bf16_compress_hook on DDP's "
    "reducer (compare with a bf16 parameter-server wire).",
)
@click.option(
    "--weighted",
    is_flag=True,
    help="Weighted DDP: each rank's local batch proportional to its speed (measured on a few "
    "steps at start), gradients combined as the sum of (b_i / B) g_i; plain DDP without it.",
)
@click.option(
    "--shares",
    default=None,
    help="Weighted DDP: the ranks' speeds, comma-separated in --slowdowns order (>= 0, not "
    "all 0; a rank with 0 computes nothing), instead of measuring them.",
)
@click.option(
    "--rebalance",
    type=click.Choice(REBALANCE),
    default="none",
    help="Weighted DDP: epoch re-splits the global batch at each epoch's start by the speeds "
    "the last epoch's steps measured; none keeps the first split.",
)
@checkpoint_option
@folder_options
@progress_option
@link_options
@budget_options
def ddp(
    target_oa: float | None,
    progress: bool,
    shares: str | None,
    ddp_checkpoint_every: int,
    **options: Any,
) -> None:
    """Run the torch.distributed DDP baseline (one process per rank) and print the summary.

    Same data, split, model initialisation, global batch, optimizer, schedule and slowdowns as
    the parameter server; each rank computes B/N samples per step; the slowdown scales compute
    time only; rank 0 evaluates after every epoch.
    """
    setup_logging("INFO", "pslaunch ")
    train = build_train(options, target_oa)
    config = DDPConfig(
        train=train,
        **build_cluster(options),
        shares=_shares(shares),
        checkpoint_every=ddp_checkpoint_every,
        **options,
    )
    click.echo(
        f"pslaunch: {config.mode} with {config.world_size} ranks "
        f"(slowdowns {list(config.slowdowns)})"
        + (f" on {config.nodes.summary_line()}" if config.nodes else "")
        + f"; logs in {config.run_dir / 'cluster.log'}"
    )
    bar = RunProgress(train.epochs, train.max_steps, enabled=progress)
    click.echo(summary_tables(_run(lambda c: run_ddp(c, progress=bar), config)))


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
@async_options
@run_options
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
@click.option("--time", default="01:00:00", help="Each Slurm job's time limit.")
@click.option(
    "--wait-timeout",
    type=float,
    default=86400.0,
    help="Seconds to wait for one Slurm job, queueing included; then it is cancelled.",
)
@link_options
@checkpoint_option
@budget_options
@folder_options
def compare(
    modes: str,
    server_opt: tuple[str, ...],
    worker_opt: tuple[str, ...],
    progress: bool,
    partition: str | None,
    time: str,
    wait_timeout: float,
    **options: Any,
) -> None:
    """Run every mode REPEATS times on the same data, seeds and slowdowns; write a report."""
    setup_logging("WARNING", "pslaunch ")
    if options["epochs"] is None and options["max_steps"] is None:
        options["epochs"] = 5
    train = build_train(options)
    config = CompareConfig(
        train=train,
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
        **build_cluster(options),
        server_options=server_opt,
        worker_options=worker_opt,
        slurm=SlurmRuns(partition=partition, time=time, wait_timeout_s=wait_timeout),
        **options,
    )
    warn_unbudgeted_server(config.nodes)
    data = _run(lambda c: run_compare(c, show_progress=progress), config)
    click.echo((config.out / "report.md").read_text(encoding="utf-8"))
    click.echo(files_written(config.out, data.get("report") or {}))
    failed = [f"{r['mode']} #{r['repeat']} ({r['error']})" for r in data["runs"] if "error" in r]
    if failed:
        raise click.ClickException(f"runs failed: {'; '.join(failed)}; see their cluster.log")


def _shares(text: str | None) -> tuple[float, ...]:
    """``--shares`` as numbers (validated with the configuration).

    Raises:
        click.BadParameter: an entry is not a number.
    """
    try:
        return tuple(float(v) for v in text.split(",")) if text else ()
    except ValueError:
        message = f"--shares {text!r} takes numbers such as 0.4,0.4,0.2,0.1"
        raise click.BadParameter(message) from None


def _run(runner: Callable[[Any], Any], config: Any) -> Any:
    """Run ``runner(config)``, turning project errors and Ctrl-C into CLI exits."""
    try:
        return runner(config)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        summary = Path(getattr(config, "run_dir", "")) / "summary.json"
        written = f"; summary: {summary}" if summary.is_file() else ""
        click.echo(f"pslaunch: interrupted; the processes were stopped{written}", err=True)
        sys.exit(130)


main.add_command(slurm)
main.add_command(simulate)
show_envvars(main)  # PSLAUNCH_<COMMAND>_<OPTION>, e.g. PSLAUNCH_LOCAL_WORKERS

if __name__ == "__main__":
    sys.exit(main())
