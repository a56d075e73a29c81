"""Helpers a Slurm job script runs on its nodes: the server's address, workers, shards."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import click

from common.config import need
from common.errors import ConfigError, PSError
from common.procs import is_running
from launch.procs import wait_for_start
from launch.slurm.placement import node_address, pick_device


def worker_command(
    name_prefix: str, slowdowns: str, gpu: bool, env: Mapping[str, str], rest: tuple[str, ...]
) -> list[str]:
    """The ``worker join`` command line of this srun task.

    Args:
        name_prefix: worker names are ``<prefix><SLURM_PROCID>-x<slowdown>``.
        slowdowns: comma-separated slowdowns by task rank; one value applies to every task.
        gpu: the task was given GPUs.
        env: the task's environment (``SLURM_PROCID`` must be set).
        rest: further ``worker join`` options (``--server`` among them).

    Returns:
        The argument vector to execute.

    Raises:
        ConfigError: not inside an srun task, or no slowdown for this rank.
    """
    need("SLURM_PROCID" in env, "SLURM_PROCID is not set: run this inside an srun step")
    rank = int(env["SLURM_PROCID"])
    factors = [part.strip() for part in slowdowns.split(",") if part.strip()]
    if len(factors) == 1:
        factor = factors[0]
    elif 0 <= rank < len(factors):
        factor = factors[rank]
    else:
        raise ConfigError(f"task {rank} has no slowdown in {slowdowns!r}")
    return [
        sys.executable,
        "-m",
        "worker.cli",
        "join",
        "--name",
        f"{name_prefix}{rank}-x{factor}",
        "--slowdown",
        factor,
        "--device",
        pick_device(gpu, env),
        *rest,
    ]


def shard_command(
    name_prefix: str, env: Mapping[str, str], rest: tuple[str, ...], host: str | None = None
) -> list[str]:
    """The ``pserver shard`` command line of this srun task.

    Args:
        name_prefix: shard names are ``<prefix><SLURM_PROCID>-<node>``.
        env: the task's environment (``SLURM_PROCID``, ``SLURMD_NODENAME``).
        rest: further ``pserver shard`` options (``--coordinator`` among them).
        host: the address to listen on (default: this node's ``NodeAddr``).

    Returns:
        The argument vector to execute.

    Raises:
        ConfigError: not inside an srun task.
    """
    if "SLURM_PROCID" not in env or "SLURMD_NODENAME" not in env:
        raise ConfigError("SLURM_PROCID/SLURMD_NODENAME are not set: run this in an srun step")
    node = env["SLURMD_NODENAME"]
    return [
        sys.executable,
        "-m",
        "pserver.cli",
        "shard",
        "--bind",
        f"tcp://{host or node_address(node)}:0",
        "--name",
        f"{name_prefix}{env['SLURM_PROCID']}-{node}",
        *rest,
    ]


@click.group()
def main() -> None:
    """Run inside a Slurm job written by 'pslaunch slurm'."""


@main.command()
@click.option("--run-dir", required=True, type=click.Path(path_type=Path), help="Run directory.")
@click.option(
    "--offset", default=0, show_default=True, help="metrics.jsonl's size before the server started."
)
@click.option("--pid", required=True, type=int, help="The server's process id.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait.")
def address(run_dir: Path, offset: int, pid: int, timeout: float) -> None:
    """Print the address of the server started by this job (process PID) once it writes its
    ``start`` event; only events after byte OFFSET of metrics.jsonl count, so an earlier
    attempt's event is never taken."""

    def gone() -> str | None:
        return None if is_running(pid) else f"the server (pid {pid}) exited before it listened"

    try:
        click.echo(wait_for_start(run_dir / "metrics.jsonl", offset, timeout, gone))
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option("--gpu/--no-gpu", default=False, show_default=True, help="The task has GPUs.")
def device(gpu: bool) -> None:
    """Print the device this srun task's worker would use, with its SLURM_PROCID."""
    try:
        click.echo(f"{os.environ.get('SLURM_PROCID', '-')} {pick_device(gpu, os.environ)}")
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--name-prefix", default="w", show_default=True, help="Worker name prefix.")
@click.option("--slowdowns", default="1", show_default=True, help="Slowdown per task rank.")
@click.option("--gpu/--no-gpu", default=False, show_default=True, help="The task has GPUs.")
@click.argument("rest", nargs=-1, type=click.UNPROCESSED)
def worker(name_prefix: str, slowdowns: str, gpu: bool, rest: tuple[str, ...]) -> None:
    """Replace this process with 'worker join' for this srun task (REST: its options)."""
    try:
        argv = worker_command(name_prefix, slowdowns, gpu, os.environ, rest)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.stdout.flush()
    os.execv(argv[0], argv)


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--name-prefix", default="shard", show_default=True, help="Shard name prefix.")
@click.argument("rest", nargs=-1, type=click.UNPROCESSED)
def shard(name_prefix: str, rest: tuple[str, ...]) -> None:
    """Replace this process with 'pserver shard' on this node (REST: its options)."""
    try:
        argv = shard_command(name_prefix, os.environ, rest)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.stdout.flush()
    os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())
