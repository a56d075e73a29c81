"""``worker``: join a parameter server and train until it says stop."""

from __future__ import annotations

import socket
import sys

import click

from common.errors import PSError
from common.logsetup import setup_logging
from worker.config import WorkerConfig


@click.group(context_settings={"auto_envvar_prefix": "WORKER", "show_default": True})
def main() -> None:
    """Training worker for the remote-sensing parameter server."""


@main.command()
@click.option("--server", required=True, help="Server endpoint, e.g. tcp://HOST:5555.")
@click.option("--device", default="cpu", help="cpu, cuda or cuda:N.")
@click.option(
    "--slowdown",
    default=1.0,
    type=float,
    help="Emulate a device F times slower: after t s of compute, wait (F-1)*t s.",
)
@click.option(
    "--slowdown-schedule",
    default="",
    help="Change the slowdown during training: STEP:F[,STEP:F...], e.g. 200:3 makes the worker "
    "3x slower from its 200th step on.",
)
@click.option(
    "--name",
    default=socket.gethostname,
    show_default="this host's name",
    help="Worker name in logs and metrics.",
)
@click.option("--threads", default=1, type=int, help="Torch CPU threads.")
@click.option(
    "--join-timeout",
    "join_timeout_s",
    default=60.0,
    type=float,
    help="Seconds to wait for the server to accept the join.",
)
@click.option(
    "--reply-timeout",
    "reply_timeout_s",
    default=600.0,
    type=float,
    help="Seconds to wait for a task (sync rounds wait for the slowest worker).",
)
@click.option(
    "--data-timeout",
    "data_timeout_s",
    default=120.0,
    type=float,
    help="Seconds to wait for a data reply.",
)
@click.option(
    "--rejoin-timeout",
    "rejoin_timeout_s",
    default=120.0,
    type=float,
    help="Keep trying to rejoin a lost or restarted server for this many seconds.",
)
@click.option(
    "--curve-server-key",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="The server's public key file (server.key), for a server using CURVE.",
)
@click.option(
    "--curve-secret",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="This worker's secret key file (worker.key_secret); its public key must be authorized.",
)
@click.option(
    "--data",
    default=None,
    metavar="PATH",
    show_default="pull samples from the server",
    help="Read samples from this local or shared copy of the dataset instead of pulling them "
    "from the server; its fingerprint must match the server's.",
)
@click.option(
    "--augment/--no-augment",
    default=False,
    help="Augment training batches with random flips and 90-degree rotations, reproducibly "
    "per task.",
)
@click.option(
    "--augment-noise",
    default=0.0,
    type=float,
    metavar="STD",
    help="With --augment: add a Gaussian offset per sample and band with this standard "
    "deviation (the data have unit variance per band); 0 disables it.",
)
@click.option("--log-every", default=50, type=int, help="Log progress every N steps.")
@click.option("--log-level", default="INFO", help="Logging level.")
def join(log_level: str, **options: object) -> None:
    """Join a server and train until training ends."""
    name = str(options["name"])
    setup_logging(log_level, f"worker[{name}] ")
    try:
        config = WorkerConfig(**options).validate()  # type: ignore[arg-type]
        from worker.loop import Worker  # torch import only when training

        stats = Worker(config).run()
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    click.echo(
        f"worker {name}: {stats.steps} steps, {stats.samples} samples, "
        f"compute {stats.compute_s:.1f} s, data wait {stats.data_wait_s:.2f} s, "
        f"wall {stats.wall_s:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
