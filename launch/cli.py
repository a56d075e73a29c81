"""``pslaunch``: run a local heterogeneous cluster (server plus workers) in one command."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from common.errors import PSError
from common.logsetup import setup_logging
from launch.local import LocalCluster, run_local
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


if __name__ == "__main__":
    sys.exit(main())
