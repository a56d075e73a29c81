"""``pserver``: start a parameter server, query its status, and prepare datasets."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import click

from common.errors import PSError
from common.logsetup import setup_logging
from common.protocol.client import Connection
from common.protocol.messages import StatusReply, StatusRequest
from common.protocol.security import generate, load_client_keys
from pserver.config import MODES, OPTIMIZERS, SCHEDULES, STALENESS, ServerConfig
from pserver.data_cli import data_group
from pserver.model_cli import COMMANDS as MODEL_COMMANDS


@click.group(context_settings={"auto_envvar_prefix": "PSERVER", "show_default": True})
def main() -> None:
    """Parameter server for heterogeneous distributed training on remote-sensing data."""


@main.command()
@click.option(
    "--bind",
    default="tcp://127.0.0.1:5555",
    help="ZeroMQ endpoint to listen on (tcp://0.0.0.0:PORT for a cluster; port 0 "
    "picks a free port).",
)
@click.option(
    "--dataset",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="HDF5 dataset made by 'pserver data'.",
)
@click.option(
    "--model",
    required=True,
    help="Built-in model (hsi-cnn, hsi-3dcnn, scene-cnn, resnet18) or package.module:factory.",
)
@click.option(
    "--mode", type=click.Choice(MODES), default="weighted-sync", help="How pushes are combined."
)
@click.option("--workers", default=1, type=int, help="Workers to wait for before training starts.")
@click.option("--global-batch", default=64, type=int, help="Global batch B per update.")
@click.option(
    "--optimizer", type=click.Choice(OPTIMIZERS), default="sgd", help="Server-side optimizer."
)
@click.option("--lr", default=0.05, type=float, help="Learning rate.")
@click.option("--momentum", default=0.9, type=float, help="SGD momentum.")
@click.option("--nesterov/--no-nesterov", default=False, help="Nesterov momentum for SGD.")
@click.option("--weight-decay", default=1e-4, type=float, help="L2 weight decay.")
@click.option(
    "--lr-schedule",
    type=click.Choice(SCHEDULES),
    default="constant",
    help="Learning-rate schedule over training.",
)
@click.option(
    "--warmup-fraction",
    default=0.0,
    type=float,
    help="Linear warm-up over this fraction of training.",
)
@click.option("--epochs", type=int, default=None, help="Stop after this many epochs.")
@click.option("--max-steps", type=int, default=None, help="Stop after this many updates.")
@click.option(
    "--target-oa", type=float, default=None, help="Stop once test overall accuracy reaches this."
)
@click.option(
    "--staleness",
    type=click.Choice(STALENESS),
    default="inverse",
    help="Async learning-rate scaling by staleness tau.",
)
@click.option(
    "--staleness-a",
    default=0.5,
    type=float,
    help="Decay a of the poly, hinge and exp staleness functions.",
)
@click.option("--staleness-b", default=4.0, type=float, help="Hinge point b of 'hinge'.")
@click.option(
    "--max-staleness",
    type=int,
    default=None,
    help="Async: reject pushes more than K versions old (worker re-pulls).",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory for metrics.jsonl and summary.json.",
)
@click.option("--seed", default=0, type=int, help="Seed for initialisation and shuffling.")
@click.option(
    "--cache-mb",
    default=2048,
    type=int,
    help="Keep the sample array in memory when it is at most this large.",
)
@click.option(
    "--shutdown-timeout",
    "shutdown_timeout_s",
    default=10.0,
    type=float,
    help="Seconds to wait for workers to collect their stop.",
)
@click.option(
    "--eval-every",
    default=1,
    type=int,
    help="Evaluate on the test split every this many epochs (and always at the end).",
)
@click.option(
    "--checkpoint-every",
    type=int,
    default=None,
    help="Write a checkpoint to RUN_DIR/checkpoints every this many updates (one is always "
    "written at shutdown, also on SIGTERM, when --run-dir is given).",
)
@click.option(
    "--resume/--no-resume",
    default=False,
    help="Continue from the newest checkpoint in --run-dir (give the same other arguments).",
)
@click.option(
    "--curve-secret",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The server's CURVE secret key file (server.key_secret from 'pserver keygen'): "
    "encrypt and authenticate all traffic.",
)
@click.option(
    "--authorized-keys",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Directory of worker public keys (*.key) allowed to connect (with --curve-secret).",
)
@click.option(
    "--heartbeat",
    "heartbeat_s",
    default=1.0,
    type=float,
    help="Seconds between the heartbeats workers are asked to send.",
)
@click.option(
    "--dead-after",
    "dead_after_s",
    default=5.0,
    type=float,
    help="A worker silent this long is dropped; its unfinished samples go to others.",
)
@click.option(
    "--torch-threads",
    default=1,
    type=int,
    help="Torch threads for updates and evaluation (one is fastest for memory-bound updates "
    "on a node shared with workers).",
)
@click.option("--log-level", default="INFO", help="Logging level.")
def start(log_level: str, **options: object) -> None:
    """Start a parameter server and serve until training ends."""
    setup_logging(log_level, "pserver ")
    try:
        config = ServerConfig(**options).validate()  # type: ignore[arg-type]
        summary = asyncio.run(_serve(config))
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(summary, indent=2))


async def _serve(config: ServerConfig) -> dict:
    from pserver.server import ParameterServer  # torch import only when serving

    async with ParameterServer(config) as server:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_stop)
        click.echo(f"pserver listening on {server.address}", err=True)
        return await server.serve()


@main.command()
@click.option("--server", required=True, help="Server endpoint, e.g. tcp://HOST:5555.")
@click.option("--timeout", default=5.0, type=float, help="Seconds to wait for the reply.")
@click.option(
    "--curve-server-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The server's public key file, for a server started with --curve-secret.",
)
@click.option(
    "--curve-secret",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="This client's secret key file (its public key must be authorized).",
)
def status(
    server: str, timeout: float, curve_server_key: Path | None, curve_secret: Path | None
) -> None:
    """Print the server's status as JSON (mode, version, epoch, workers, speeds)."""
    try:
        keys = None
        if curve_server_key or curve_secret:
            if not (curve_server_key and curve_secret):
                raise click.UsageError("--curve-server-key and --curve-secret go together")
            keys = load_client_keys(curve_server_key, curve_secret)
        with Connection(server, timeout, curve=keys) as conn:
            reply = conn.request(StatusRequest())
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    assert isinstance(reply, StatusReply)
    click.echo(json.dumps(reply.status, indent=2))


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def keygen(directory: Path) -> None:
    """Write CURVE key pairs for a server and its workers into DIRECTORY.

    Gives server.key / server.key_secret, worker.key / worker.key_secret, and
    DIRECTORY/authorized_keys/ holding worker.key, ready for
    'pserver start --curve-secret DIRECTORY/server.key_secret --authorized-keys
    DIRECTORY/authorized_keys' and 'worker join --curve-server-key DIRECTORY/server.key
    --curve-secret DIRECTORY/worker.key_secret'.
    """
    for role, path in generate(directory).items():
        click.echo(f"{role}: {path}")


main.add_command(data_group)
for _command in MODEL_COMMANDS:
    main.add_command(_command)

if __name__ == "__main__":
    sys.exit(main())
