"""``worker``: join a parameter server and train until it says stop.

Every option can also be set by an environment variable such as ``WORKER_JOIN_SERVER`` (each
``--help`` shows the names).
"""

from __future__ import annotations

import functools
import socket
import sys

import click

from common.cli_env import show_envvars
from common.cli_help import FullHelpGroup, config_option
from common.errors import PSError
from common.logsetup import setup_logging
from worker.config import WorkerConfig, check_server_host

_opt = functools.partial(config_option, cls=WorkerConfig)


@click.group(
    cls=FullHelpGroup, context_settings={"auto_envvar_prefix": "WORKER", "show_default": True}
)
def main() -> None:
    """Training worker for the remote-sensing parameter server."""


@main.command()
@click.option("--server", required=True, help="Server endpoint, e.g. tcp://HOST:5555.")
@_opt("device", help="cpu, cuda or cuda:N.")
@_opt("slowdown", help="Emulate a device F times slower: after t s of compute, wait (F-1)*t s.")
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
    help="Worker name in logs and metrics: 1-64 letters, digits or ._:@+- (the first a "
    "letter or digit).",
)
@_opt("threads", help="Torch CPU threads.")
@_opt(
    "connect_timeout_s",
    help="Give up when the server cannot be reached (or keeps answering 'busy') for this many "
    "seconds at start.",
)
@click.option(
    "--allow-model",
    "allow_model",
    multiple=True,
    metavar="package.module:factory",
    help="Let the server make this worker import and build this user model (built-in models "
    "need no permission; repeat for several).",
)
@_opt(
    "reply_timeout_s",
    help="Seconds to wait for a task (sync rounds wait for the slowest worker).",
)
@_opt("data_timeout_s", help="Seconds to wait for a data reply.")
@_opt(
    "rejoin_timeout_s",
    help="Keep trying to rejoin a lost or restarted server for this many seconds.",
)
@click.option(
    "--curve-server-key",
    type=click.Path(exists=True, dir_okay=False),
    help="The server's public key file (server.key), for a server using CURVE.",
)
@click.option(
    "--curve-secret",
    type=click.Path(exists=True, dir_okay=False),
    help="This worker's secret key file (worker.key_secret); its public key must be authorized.",
)
@click.option(
    "--data",
    metavar="PATH",
    show_default="pull samples from the server",
    help="Read samples from this local or shared copy of the dataset instead of pulling them "
    "from the server; its fingerprint must match the server's.",
)
@_opt(
    "cache_mb",
    help="Keep up to this many MiB of samples pulled from the server, so later epochs do not "
    "pull them again (0: keep none; not used with --data).",
)
@click.option(
    "--augment/--no-augment",
    default=False,
    help="Augment training batches with random flips and 90-degree rotations, reproducibly "
    "per task.",
)
@_opt(
    "augment_noise",
    metavar="STD",
    help="With --augment: add a Gaussian offset per sample and band with this standard "
    "deviation (the data have unit variance per band); 0 disables it.",
)
@_opt("log_every", help="Log progress every N steps.")
@click.option("--log-level", default="INFO", help="Logging level.")
def join(log_level: str, **options: object) -> None:
    """Join a server and train until training ends."""
    name = str(options["name"])
    setup_logging(log_level, f"worker[{name}] ")
    try:
        options["allow_model"] = tuple(options["allow_model"])  # type: ignore[arg-type]
        config = WorkerConfig(**options)  # type: ignore[arg-type]
        check_server_host(config.server)  # a typo fails now, not after --connect-timeout
        from worker.loop import Worker  # torch import only when training

        stats = Worker(config).run()
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    assert stats.finish_reason is not None  # a run that returns was ended by the server
    click.echo(
        f"worker {name}: {stats.finish_reason.words} after {stats.steps} steps, "
        f"{stats.samples} samples, compute {stats.compute_s:.1f} s, "
        f"data wait {stats.data_wait_s:.2f} s, wall {stats.wall_s:.1f} s"
    )


show_envvars(main)  # WORKER_JOIN_<OPTION>, e.g. WORKER_JOIN_SERVER

if __name__ == "__main__":
    sys.exit(main())
