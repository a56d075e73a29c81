"""Helpers a Slurm job script runs on its nodes: the server's address, a task's node and device."""

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
from launch.slurm.submit import slurm_command


def pick_device(gpu: bool, env: Mapping[str, str]) -> str:
    """The device of one worker task.

    A task that has GPUs of its own (``--gpus-per-task``) or sees exactly one GPU uses
    ``cuda:0``; tasks that share the GPUs of their node use ``cuda:SLURM_LOCALID`` (modulo the
    GPUs they see).

    Args:
        gpu: the task was given GPUs.
        env: its environment (``CUDA_VISIBLE_DEVICES``, ``SLURM_GPUS_PER_TASK``,
            ``SLURM_LOCALID``).

    Returns:
        ``cpu`` or ``cuda:N``.

    Raises:
        ConfigError: GPUs were requested but ``CUDA_VISIBLE_DEVICES`` lists none.
    """
    if not gpu:
        return "cpu"
    local = int(env.get("SLURM_LOCALID", "0"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return f"cuda:{local}"
    count = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    need(count != 0, f"GPUs were requested but CUDA_VISIBLE_DEVICES is {visible!r}")
    if count == 1 or env.get("SLURM_GPUS_PER_TASK"):
        return "cuda:0"
    return f"cuda:{local % count}"


def node_address(node: str, timeout_s: float = 30.0) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``), or ``node`` itself.

    Args:
        node: a Slurm node name.
        timeout_s: how long ``scontrol`` may take.

    Returns:
        A host name or IP address.
    """
    try:
        done = slurm_command(["scontrol", "show", "node", "--oneliner", node], timeout_s)
    except (OSError, PSError):
        return node
    for token in done.stdout.split():
        if token.startswith("NodeAddr=") and len(token) > len("NodeAddr="):
            return token.split("=", 1)[1]
    return node


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


@main.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("rest", nargs=-1, type=click.UNPROCESSED)
def ddp(rest: tuple[str, ...]) -> None:
    """Run this srun task's DDP rank: replace this process with 'python -m
    launch.slurm.rendezvous' and the same options."""
    argv = [sys.executable, "-m", "launch.slurm.rendezvous", *rest]
    sys.stdout.flush()
    os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())
