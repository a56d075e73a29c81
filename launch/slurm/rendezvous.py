"""A DDP rank as an srun task: rank, world size and rendezvous from Slurm's variables.

Slurm starts one task per rank; ``SLURM_PROCID`` is the rank and ``SLURM_NTASKS`` the world
size. Task 0 hosts the rendezvous (a ``TCPStore``) in its own process, as torch's ``env://``
does. Its address: ``MASTER_ADDR`` when set, else the Slurm address (``NodeAddr``) of the
first node of ``scontrol show hostnames $SLURM_JOB_NODELIST``, where task 0 runs. Its port:
``MASTER_PORT`` when set; else task 0 binds port 0 (the kernel picks a free one, no
probe-then-bind race) and publishes ``HOST:PORT`` in a file of the run directory, which the
other tasks read (the run directory is on a file system every node sees).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import click

from common.config import need
from common.errors import ConfigError, NetworkTimeout, PSError, WaitTimeout
from common.polling import poll_until
from common.procs import POLL_S
from launch.ddp.launcher import DDPConfig, use_loopback
from launch.slurm.node import node_address, pick_device
from launch.slurm.submit import slurm_command


def first_node(nodelist: str, timeout_s: float = 30.0) -> str:
    """The first host name of a Slurm node list, expanded by ``scontrol show hostnames``.

    Args:
        nodelist: e.g. ``sl[1-3]``.
        timeout_s: how long scontrol may take.

    Returns:
        The first node's name.

    Raises:
        PSError: scontrol is missing, failed or printed nothing.
        NetworkTimeout: it did not answer in time.
    """
    done = slurm_command(["scontrol", "show", "hostnames", nodelist], timeout_s)
    names = done.stdout.split()
    if done.returncode != 0 or not names:
        raise PSError(f"scontrol show hostnames {nodelist}: {done.stderr.strip() or 'no hosts'}")
    return names[0]


@dataclasses.dataclass(frozen=True)
class SlurmRank:
    """Where one srun task stands in the DDP world.

    Attributes:
        rank: ``SLURM_PROCID``.
        world_size: ``SLURM_NTASKS``.
        master_host: the address task 0's store listens on.
        master_port: ``MASTER_PORT`` (None: task 0 picks one and publishes it).
        address_file: where task 0 publishes ``HOST:PORT`` when it picked the port.
    """

    rank: int
    world_size: int
    master_host: str
    master_port: int | None
    address_file: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str], run_dir: Path) -> SlurmRank:
        """Read the task's place from its environment.

        Args:
            env: the task's environment.
            run_dir: the run directory (for the published address).

        Returns:
            The task's place.

        Raises:
            ConfigError: not inside an srun step, or a variable is malformed.
            PSError: the first node's address cannot be found.
        """
        missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID") if k not in env]
        need(not missing, f"{', '.join(missing)} not set: run this inside an srun step")
        try:
            rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
            port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
        except ValueError as exc:
            raise ConfigError(f"a Slurm or MASTER_PORT variable is not a number: {exc}") from exc
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT must be in 1..65535, got {port}")
        host = env.get("MASTER_ADDR") or node_address(first_node(env["SLURM_JOB_NODELIST"]))
        step = f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
        return cls(rank, world, host, port, run_dir / f"rendezvous-{step}")

    def on_loopback(self) -> bool:
        """The master address is a loopback address (every rank is on this machine)."""
        try:
            return ipaddress.ip_address(self.master_host).is_loopback
        except ValueError:
            return self.master_host == "localhost"


def host_store(place: SlurmRank, timeout_s: float) -> tuple[Any, str]:
    """Task 0: start the rendezvous store and publish its address if the port was picked.

    Args:
        place: task 0's place.
        timeout_s: how long the ranks may take to meet.

    Returns:
        The store (keep it alive for the run) and its ``HOST:PORT``.
    """
    from torch.distributed import TCPStore

    store = TCPStore(
        place.master_host,
        place.master_port or 0,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    address = f"{place.master_host}:{store.port}"
    if place.master_port is None:
        tmp = place.address_file.with_suffix(".tmp")
        tmp.write_text(address + "\n", encoding="utf-8")
        tmp.replace(place.address_file)  # readers never see half a line
    return store, address


def store_address(place: SlurmRank, timeout_s: float) -> str:
    """Tasks > 0: the rendezvous address, waiting for task 0 to publish it when needed.

    The file is re-read every 0.2 s: there is no portable file-change notification (and none
    at all across the nodes of a shared file system).

    Args:
        place: the task's place.
        timeout_s: how long to wait for the published address.

    Returns:
        ``HOST:PORT``.

    Raises:
        NetworkTimeout: task 0 published nothing within ``timeout_s``.
    """
    if place.master_port is not None:
        return f"{place.master_host}:{place.master_port}"

    def published() -> str:
        try:
            return place.address_file.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return ""

    try:
        return poll_until(published, timeout_s, POLL_S, "task 0's rendezvous address")
    except WaitTimeout as exc:
        raise NetworkTimeout(
            f"task 0 published no rendezvous address in {place.address_file} within {timeout_s:g} s"
        ) from exc


def task_config(
    config: DDPConfig, config_path: Path, place: SlurmRank, gpu: bool, env: Mapping[str, str]
) -> Path:
    """The configuration this task's rank reads: the job's, or a copy naming its own GPU.

    Args:
        config: the job's configuration.
        config_path: the file it was read from (``ddp_config.json``).
        place: the task's place.
        gpu: the task was given GPUs (its device comes from Slurm, as for workers).
        env: the task's environment.

    Returns:
        The path of the configuration to run.

    Raises:
        ConfigError: the configuration's ranks do not match ``SLURM_NTASKS``.
    """
    need(
        config.world_size == place.world_size,
        f"{config_path} has {config.world_size} ranks (slowdowns) but the step has "
        f"SLURM_NTASKS={place.world_size} tasks",
    )
    if not gpu:
        return config_path
    mine = dataclasses.replace(config, devices=(pick_device(True, env),))
    path = config_path.with_name(f"ddp_config-{place.rank}.json")
    path.write_text(mine.to_json(), encoding="utf-8")
    return path


def run_slurm_rank(config_path: Path, gpu: bool, env: MutableMapping[str, str]) -> None:
    """Run this srun task's DDP rank (task 0 also hosts the rendezvous); returns only when
    the world has a single rank (the rank's entry point ends the process otherwise).

    Args:
        config_path: the job's ``ddp_config.json``.
        gpu: the task was given GPUs.
        env: the process environment (``os.environ``; gloo's interface may be set in it).

    Raises:
        ConfigError: not inside an srun step, or the step does not match the configuration.
        PSError: the rendezvous could not be set up.
    """
    from launch.ddp import rank as ddp_rank  # torch only inside the task

    config = DDPConfig.from_json(config_path.read_text(encoding="utf-8"))
    place = SlurmRank.from_env(env, config.run_dir)
    path = task_config(config, config_path, place, gpu, env)
    if place.on_loopback():
        use_loopback(env)  # every rank is on this machine
    args = ["--config", str(path), "--rank", str(place.rank)]
    store = None
    if place.world_size > 1:
        if place.rank == 0:
            store, address = host_store(place, config.startup_timeout_s)
        else:
            address = store_address(place, config.startup_timeout_s)
        args += ["--store", address]
    ddp_rank.main(args)  # with several ranks this ends the process, store included
    del store


@click.command()
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The job's ddp_config.json.",
)
@click.option("--gpu/--no-gpu", default=False, show_default=True, help="The task has GPUs.")
def main(config_path: Path, gpu: bool) -> None:
    """Run this srun task's DDP rank (SLURM_PROCID of SLURM_NTASKS); task 0 hosts the
    rendezvous."""
    try:
        run_slurm_rank(config_path, gpu, os.environ)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc


if __name__ == "__main__":
    sys.exit(main())
