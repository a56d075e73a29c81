"""``pserver``: start a parameter server or a shard, query status, prepare datasets.

Every option can also be set by an environment variable named after the command and the
option, e.g. ``PSERVER_START_MODE=async`` or ``PSERVER_SHARD_COORDINATOR=tcp://...`` (each
``--help`` shows the names).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common import eventloop
from common.cli_env import show_envvars
from common.cli_help import FullHelpGroup, config_option
from common.config import default
from common.errors import PSError
from common.logsetup import setup_logging
from common.protocol.client import Connection
from common.protocol.messages import StatusReply, StatusRequest
from common.protocol.security import generate, load_client_keys
from common.protocol.wire import WIRE_DTYPES
from common.training.models import NORMS, with_norm
from pserver.cli.data_cli import data_group
from pserver.cli.model_cli import COMMANDS as MODEL_COMMANDS
from pserver.config import (
    MODES,
    OPTIMIZERS,
    PLANNERS,
    SCHEDULES,
    STALENESS,
    ServerConfig,
    ShardConfig,
)
from pserver.policies.weighted_sync import BATCHNORM_MIN_LOCAL_BATCH

CONTEXT = {"auto_envvar_prefix": "PSERVER", "show_default": True}


_opt = functools.partial(config_option, cls=ServerConfig)
_shard_opt = functools.partial(config_option, cls=ShardConfig)


def _path(**kwargs: Any) -> click.Path:
    return click.Path(path_type=Path, **kwargs)


@click.group(cls=FullHelpGroup, context_settings=CONTEXT)
def main() -> None:
    """Parameter server for heterogeneous distributed training on remote-sensing data."""


@main.command()
@_opt(
    "bind",
    help="ZeroMQ endpoint to listen on (tcp://0.0.0.0:PORT for a cluster; port 0 "
    "picks a free port).",
)
@click.option(
    "--dataset",
    required=True,
    type=_path(exists=True, dir_okay=False),
    help="HDF5 dataset made by 'pserver data'.",
)
@click.option(
    "--model",
    required=True,
    help="Built-in model (hsi-cnn, hsi-3dcnn, scene-cnn, resnet18) or package.module:factory.",
)
@_opt("mode", type=click.Choice(MODES), help="How pushes are combined.")
@_opt(
    "planner",
    type=click.Choice(PLANNERS),
    help="weighted-sync: plan local batches so predicted round times are equal on fitted "
    "per-worker models (model: fixed cost, per-sample cost and transfer time; compute: the "
    "same without transfer time), or in proportion to speed.",
)
@_opt(
    "plan_spread",
    flag="--plan-spread/--no-plan-spread",
    help="With --planner model: leave out a worker whose share shortens the predicted round "
    "less than the expected wait its scatter adds at the barrier (measured round by round).",
)
@_opt(
    "min_local_batch",
    type=click.IntRange(min=1),
    help="weighted-sync: the smallest local batch a worker is given; a worker whose share "
    "would be smaller sits out the round (and is probed with this many samples now and "
    f"then). Default: {BATCHNORM_MIN_LOCAL_BATCH} (at most B / --workers) for models with "
    "BatchNorm, whose batch statistics come from the local batch; else 1.",
)
@click.option(
    "--norm",
    type=click.Choice(NORMS),
    default="batch",
    help="Normalisation of a built-in model: batch (BatchNorm) or group (GroupNorm, recorded "
    "as MODEL-gn: no batch statistics, so speed-sized local batches give exactly one "
    "global-batch step).",
)
@_opt("workers", help="Workers to wait for before training starts.")
@_opt("global_batch", help="Global batch B per update.")
@_opt("optimizer", type=click.Choice(OPTIMIZERS), help="Server-side optimizer.")
@_opt("lr", help="Learning rate.")
@_opt("momentum", help="SGD momentum.")
@_opt("nesterov", flag="--nesterov/--no-nesterov", help="Nesterov momentum for SGD.")
@_opt("weight_decay", help="L2 weight decay.")
@_opt("lr_schedule", type=click.Choice(SCHEDULES), help="Learning-rate schedule over training.")
@_opt("warmup_fraction", help="Linear warm-up over this fraction of training.")
@_opt("epochs", help="Stop after this many epochs.")
@_opt("max_steps", help="Stop after this many updates.")
@_opt("target_oa", help="Stop once test overall accuracy reaches this.")
@_opt("staleness", type=click.Choice(STALENESS), help="Async learning-rate scaling by staleness.")
@_opt("staleness_a", help="Decay a of the poly, hinge and exp staleness functions.")
@_opt("staleness_b", help="Hinge point b of 'hinge'.")
@_opt("max_staleness", help="Async: refuse pushes more than K versions old (the worker re-pulls).")
@_opt(
    "run_dir",
    type=_path(file_okay=False),
    help="Directory for metrics.jsonl, summary.json and checkpoints.",
)
@_opt(
    "overwrite",
    flag="--overwrite/--no-overwrite",
    help="Replace the run already in --run-dir (without it, such a directory is refused).",
)
@_opt("seed", help="Seed for initialisation and shuffling.")
@_opt("cache_mb", help="Keep the sample array in memory when it is at most this large.")
@_opt(
    "eval_every",
    help="Evaluate every this many epochs (and always at the end; 0: only at the end).",
)
@_opt(
    "eval_every_updates",
    help="Also evaluate every this many updates (the newest version; superseded ones are "
    "skipped when evaluation falls behind).",
)
@_opt(
    "eval_samples",
    help="In-run evaluations use a fixed stratified subset of this many test samples (default: "
    "the whole split until evaluations fall behind, then a subset that fits); the final "
    "evaluation always uses the whole test split.",
)
@_opt(
    "shutdown_timeout_s",
    help="Seconds the whole shutdown may take after training ends (final checkpoint, final "
    "evaluation, stopping workers, summary).",
)
@click.option(
    "--write-timeout",
    "write_timeout",
    default=default(ServerConfig, "write_timeout_s"),
    type=float,
    help="Seconds one checkpoint or snapshot write may take; a write still stuck then (a "
    "stalled disk) is abandoned and reported, and the run goes on or ends without it.",
)
@_opt(
    "checkpoint_every",
    help="Write a checkpoint to RUN_DIR/checkpoints every this many updates (one is always "
    "written at shutdown, also on SIGTERM, when --run-dir is given).",
)
@_opt(
    "keep_best",
    flag="--keep-best/--no-keep-best",
    help="Keep RUN_DIR/checkpoints/best.npz: the state of the best OA on the whole test split "
    "so far ('pserver export --best' exports it).",
)
@_opt(
    "snapshot_every_updates",
    help="Save the state of every N-th version to RUN_DIR/snapshots for 'pserver "
    "evaluate-snapshots' (off by default; disk: at most --snapshot-limit states).",
)
@_opt(
    "snapshot_limit",
    help="Snapshots kept at most; beyond it every other one is deleted and the interval doubles.",
)
@_opt(
    "resume",
    flag="--resume/--no-resume",
    help="Continue from the newest checkpoint in --run-dir (give the same other arguments).",
)
@_opt(
    "curve_secret",
    type=_path(exists=True, dir_okay=False),
    help="The server's CURVE secret key file (server.key_secret from 'pserver keygen'): "
    "encrypt and authenticate all traffic.",
)
@_opt(
    "authorized_keys",
    type=_path(exists=True, file_okay=False),
    help="Directory of worker public keys (*.key) allowed to connect (with --curve-secret).",
)
@_opt("heartbeat_s", help="Seconds between the heartbeats workers are asked to send.")
@_opt(
    "dead_after_s",
    help="A worker silent this long is dropped; its unfinished samples go to others.",
)
@_opt("torch_threads", help="Torch threads for updates and evaluation.")
@_opt(
    "shards",
    help="Parameter shards: 1 keeps the parameters in this process; K > 1 makes this server "
    "the coordinator and waits for K 'pserver shard' servers, each holding 1/K of the state.",
)
@_opt(
    "shard_secret_file",
    type=_path(exists=True, dir_okay=False),
    help="With --shards K: a file of at least 16 secret bytes that every 'pserver shard "
    "--secret-file' also reads; only shards that prove it may register (default with CURVE: "
    "a secret derived from --curve-secret).",
)
@_opt(
    "wire_dtype",
    type=click.Choice(WIRE_DTYPES),
    help="Format of gradients and parameters on the wire (master weights stay fp32).",
)
@_opt("chunk_mb", help="Large transfers travel in chunks of about this many MB.")
@_opt(
    "max_grad_norm",
    help="Clip each push to this gradient norm (off by default: absurd outliers are refused "
    "instead, see --outlier-factor).",
)
@_opt(
    "outlier_factor",
    help="Refuse a push whose gradient norm exceeds this many times the typical one (the "
    "lower median over members of their recent medians; the third push of the same task is "
    "taken, clipped to the typical norm).",
)
@_opt(
    "stage_timeout_s",
    help="Seconds a push's gradient chunks may take to arrive after the push is announced.",
)
@_opt("shard_timeout_s", help="Seconds a shard may take to answer the coordinator.")
@_opt("max_workers", help="Members the run accepts at most.")
@_opt(
    "http_port",
    flag="--http",
    help="Serve a read-only live status page, /status.json and /metrics on this port "
    "(0 picks a free one; off by default).",
)
@_opt("http_bind", help="Address the status page binds (0.0.0.0 exposes it to the network).")
@click.option("--log-level", default="INFO", help="Logging level.")
@click.option(
    "--json",
    is_flag=True,
    help="End by printing the whole summary as JSON instead of the results tables.",
)
def start(log_level: str, norm: str, **options: Any) -> None:
    """Start a parameter server (the coordinator) and serve until training ends."""
    as_json = options.pop("json")
    setup_logging(log_level, "pserver ")
    try:
        options["write_timeout_s"] = options.pop("write_timeout")
        options["model"] = with_norm(options["model"], norm)
        config = ServerConfig(**options)
        summary, error, interrupted = eventloop.run(_serve(config))
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _echo_results(summary, config.run_dir)
    if error:
        raise click.ClickException(error)
    if interrupted:
        click.echo(f"pserver: interrupted; {_written(summary, config.run_dir)}", err=True)
        sys.exit(128 + interrupted)


def _written(summary: dict[str, Any], run_dir: Path | None) -> str:
    """What an interrupted server left: a checkpoint only once an update was applied."""
    if run_dir is None:
        return "nothing written (no --run-dir)"
    if not summary.get("steps"):
        return "no update was applied, so no checkpoint; summary written"
    return "checkpoint and summary written"


def _echo_results(summary: dict[str, Any], run_dir: Path | None) -> None:
    """The same short tables as ``pslaunch local``, and where the summary is."""
    from common.training.tables import summary_tables

    try:
        click.echo(summary_tables(summary))
    except (KeyError, TypeError):  # a run that ended before training: nothing to tabulate
        click.echo(json.dumps(summary, indent=2))
    where = run_dir / "summary.json" if run_dir is not None else None
    if where is not None and where.is_file():
        click.echo(f"summary: {where}")
    else:
        click.echo("summary: not written (no --run-dir); --json prints it here")


def _on_signals(stop: Callable[[], None], received: list[int]) -> None:
    """First SIGINT/SIGTERM: graceful stop (noted in ``received``); a second one exits at once."""
    loop = asyncio.get_running_loop()

    def handle(sig: int) -> None:
        if received:
            os._exit(128 + sig)
        received.append(sig)
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)


async def _serve(config: ServerConfig) -> tuple[dict[str, Any], str, int]:
    from pserver.server import run_server  # torch import only when serving

    received: list[int] = []

    def listening(address: str, stop: Callable[[], None]) -> None:
        _on_signals(stop, received)
        click.echo(f"pserver listening on {address}", err=True)

    summary, error = await run_server(config, listening)
    return summary, error, received[0] if received else 0


@main.command()
@click.option(
    "--coordinator",
    required=True,
    help="The coordinator's endpoint (its 'pserver start --bind').",
)
@_shard_opt("bind", help="Endpoint this shard listens on (port 0 picks a free port).")
@_shard_opt(
    "advertise",
    help="Address workers use to reach this shard, when --bind is 0.0.0.0 (port 0 takes the "
    "bound port).",
)
@_shard_opt("name", show_default="this host's name", help="Shard name in logs.")
@_shard_opt(
    "connect_timeout_s",
    help="Give up when the coordinator cannot be reached for this long.",
)
@_shard_opt(
    "curve_secret",
    type=_path(exists=True, dir_okay=False),
    help="The server's CURVE secret key file (the coordinator's --curve-secret).",
)
@_shard_opt(
    "authorized_keys",
    type=_path(exists=True, file_okay=False),
    help="Directory of worker public keys allowed to connect (the coordinator's).",
)
@_shard_opt(
    "secret_file",
    type=_path(exists=True, dir_okay=False),
    help="The coordinator's --shard-secret-file, proved at registration (default with "
    "--curve-secret: a secret derived from it).",
)
@_shard_opt("torch_threads", help="Torch threads for updates.")
@click.option("--log-level", default="INFO", help="Logging level.")
def shard(log_level: str, **options: Any) -> None:
    """Serve one parameter shard for a coordinator started with --shards K."""
    setup_logging(log_level, "shard ")
    try:
        from pserver.store.shard_server import serve_shard

        reason, ended = eventloop.run(serve_shard(ShardConfig(**options)))
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"shard stopped: {reason}", err=True)
    if not ended:  # a signal or the coordinator's silence
        sys.exit(1)


@main.command()
@click.option("--server", required=True, help="Server endpoint, e.g. tcp://HOST:5555.")
@click.option("--timeout", default=5.0, type=float, help="Seconds to wait for the reply.")
@click.option(
    "--curve-server-key",
    type=_path(exists=True, dir_okay=False),
    help="The server's public key file, for a server started with --curve-secret.",
)
@click.option(
    "--curve-secret",
    type=_path(exists=True, dir_okay=False),
    help="This client's secret key file (its public key must be authorized).",
)
def status(
    server: str, timeout: float, curve_server_key: Path | None, curve_secret: Path | None
) -> None:
    """Print the server's status as JSON (mode, version, epoch, workers, speeds, shards)."""
    if not server.startswith(("tcp://", "ipc://", "inproc://")):
        raise click.ClickException(f"--server {server!r} must look like tcp://HOST:PORT")
    try:
        keys = None
        if curve_server_key or curve_secret:
            if not (curve_server_key and curve_secret):
                raise click.UsageError("--curve-server-key and --curve-secret go together")
            keys = load_client_keys(curve_server_key, curve_secret)
        with Connection(server, timeout, curve=keys) as conn:
            reply = conn.request(StatusRequest(), expect=StatusReply)
    except PSError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(reply.status, indent=2))


@main.command()
@click.argument("directory", type=_path(file_okay=False))
def keygen(directory: Path) -> None:
    """Write CURVE key pairs for a server and its workers into DIRECTORY.

    Gives server.key / server.key_secret, worker.key / worker.key_secret, and
    DIRECTORY/authorized_keys/ holding worker.key, ready for
    'pserver start --curve-secret DIRECTORY/server.key_secret --authorized-keys
    DIRECTORY/authorized_keys' (shards take the same two options) and 'worker join
    --curve-server-key DIRECTORY/server.key --curve-secret DIRECTORY/worker.key_secret'.
    """
    for role, path in generate(directory).items():
        click.echo(f"{role}: {path}")


main.add_command(data_group)
for _command in MODEL_COMMANDS:
    main.add_command(_command)
show_envvars(main)  # PSERVER_<COMMAND>_<OPTION>, e.g. PSERVER_START_MODE

if __name__ == "__main__":
    sys.exit(main())
