"""``pslaunch simulate``: predict round and epoch times of every mode on a cluster this machine
cannot hold, from a spec file or calibrated on real runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from common.config import need
from common.errors import ConfigError
from launch.simulate.engine import SIM_MODES
from launch.simulate.fromrun import cluster_from_runs
from launch.simulate.report import LEGEND, document, table, write
from launch.simulate.spec import MAX_NODES, WIRE_BYTES, load_spec
from launch.simulate.sweep import AXES, notes, parse_sweep, run_grid, vary
from pserver.config import PLANNERS, STALENESS

F = TypeVar("F", bound=Callable[..., Any])


def _overriding(
    name: str, kind: click.ParamType, what: str, default: str = "the spec's or the run's"
) -> Callable[[F], F]:
    """An option that overrides the cluster's value (not given: the cluster's own)."""
    return click.option(name, type=kind, default=None, help=f"{what} (default: {default}).")


def _modes(text: str) -> list[str]:
    modes = list(SIM_MODES) if text == "all" else [m.strip() for m in text.split(",")]
    bad = [m for m in modes if m not in SIM_MODES]
    if bad or not modes:
        raise click.BadParameter(f"choose from {', '.join(SIM_MODES)} or all, got {text!r}")
    return modes


@click.command()
@click.option(
    "--spec",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Cluster spec, YAML or JSON (docs/scale.md shows the keys).",
)
@click.option(
    "--from",
    multiple=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Run directory to calibrate on (repeatable): the first parameter-server run "
    "gives each worker's fitted model, the server's step time and the spread of "
    "round times (an async run: each worker's push time and the server's time per push); "
    "a DDP run gives the all-reduce time per step.",
)
@click.option(
    "--mode",
    default="all",
    help="Mode, a comma-separated list, or all: " + ", ".join(SIM_MODES) + ".",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1, max=MAX_NODES),
    default=None,
    help="Nodes (default: as given); groups keep their ratios, run workers repeat.",
)
@_overriding("--shards", click.IntRange(min=1, max=MAX_NODES), "Parameter shards K")
@click.option(
    "--colocated/--dedicated-shards",
    default=None,
    help="Shards on worker hosts, or on their own server hosts (default: the "
    "spec's; runs: dedicated).",
)
@_overriding(
    "--wire-dtype", click.Choice(list(WIRE_BYTES)), "Wire dtype of parameters and gradients"
)
@_overriding("--global-batch", click.IntRange(min=1), "Global batch B")
@_overriding("--samples", click.IntRange(min=1), "Training samples per epoch")
@_overriding(
    "--staleness", click.Choice(STALENESS), "Async staleness function", "the spec's, else inverse"
)
@_overriding(
    "--max-staleness", click.IntRange(min=0), "Async staleness bound", "the spec's, else none"
)
@_overriding(
    "--planner",
    click.Choice(PLANNERS),
    "Weighted-sync's planner",
    "the spec's or the run's, else model",
)
@_overriding(
    "--min-local-batch",
    click.IntRange(min=1),
    "Weighted-sync's smallest local batch",
    "the spec's or the run's, else 1",
)
@click.option("--epochs", type=click.IntRange(min=1), default=1, help="Epochs to simulate.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Simulate at most this many rounds (async: pushes per worker) and "
    "extrapolate the epoch time.",
)
@click.option(
    "--plan-spread/--no-plan-spread",
    default=True,
    help="Weighted-sync weighs the spread of round times, as the server does.",
)
@click.option(
    "--sweep",
    multiple=True,
    help="Grid axes, e.g. 'workers=8,16,32 shards=1,2,4' (repeatable); axes: "
    + ", ".join(AXES)
    + ".",
)
@click.option("--seed", type=int, default=0, help="Seed of node speeds and jitter.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write simulate.json (and plots for sweeps over workers or shards) here.",
)
@click.option("--json", is_flag=True, help="Print JSON instead of the table.")
def simulate(
    spec: Path | None,
    mode: str,
    workers: int | None,
    sweep: tuple[str, ...],
    epochs: int,
    rounds: int | None,
    plan_spread: bool,
    seed: int,
    out: Path | None,
    **overrides: Any,
) -> None:
    """Simulate training rounds on a cluster: round and epoch time, idle share, bytes per
    link and staleness of each mode, planned by the server's own planner."""
    from_runs: tuple[Path, ...] = overrides.pop("from")  # a Python keyword: not a parameter
    as_json: bool = overrides.pop("json")
    try:
        need((spec is None) != (not from_runs), "give exactly one of --spec FILE or --from RUN_DIR")
        if spec is not None:
            cluster = load_spec(spec, seed=seed)
            source = str(spec)
        else:
            cluster = cluster_from_runs(from_runs)
            source = ", ".join(str(p) for p in from_runs)
        given = {"workers": workers, **overrides}
        cluster = vary(cluster, {k: v for k, v in given.items() if v is not None})
        axes = parse_sweep(sweep) or {}
        args = {"epochs": epochs, "max_rounds": rounds, "seed": seed, "plan_spread": plan_spread}
        rows = run_grid(cluster, _modes(mode), axes, **args)
        found = notes(cluster, rows, **args)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(document(cluster, rows, source, found), indent=1))
    else:
        click.echo(table(rows))
        click.echo(LEGEND)
        click.echo("\nNode groups (members a round, share of the samples):\n" + "\n".join(found))
    if out is not None:
        for path in write(out, cluster, rows, source, found):
            click.echo(f"wrote {path}", err=True)
