"""``python -m bench NAME [options]``: run one bench and keep its result; ``report`` renders them.

Each bench keeps its own options (``python -m bench NAME --help``); the run's figures, settings
and machine go to ``bench/results/NAME.json`` unless ``--out`` names another file. Where a bench
puts its run folders and scratch files (its own ``--out DIR`` or ``--dir DIR``) is left out of
the kept command and settings: it changes no figure, and a kept result names no local path.
"""

from __future__ import annotations

import dataclasses
import importlib
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from bench import ROOT
from bench.harness.record import (
    RESULTS_DIR,
    Result,
    make_result,
    read_results,
    recording,
    results_by_name,
)
from bench.report import README, RESULTS_DOC, readme_table, render, with_readme_table

RERUN_TIMEOUT_S = 4 * 3600.0
PLACE_OPTIONS = ("--out", "--dir")


@dataclasses.dataclass(frozen=True)
class Bench:
    """A bench as the command line offers it: its module, one line, options put before the
    user's (a bench that is a mode of another's), and the module's function that takes the
    arguments (``main(argv)``)."""

    module: str
    summary: str
    options: tuple[str, ...] = ()
    function: str = "main"


BENCHES: dict[str, Bench] = {
    "chaos": Bench("bench.chaos", "random kills and stops in 3 runs; their histories checked"),
    "coordinator-memory": Bench(
        "bench.memory",
        "the coordinator's peak memory serving a 1.7 GB file (memory --kinds coordinator)",
        ("--kinds", "coordinator"),
    ),
    "ddp-fidelity": Bench("bench.ddp_fidelity", "pslaunch ddp against a plain DDP loop"),
    "idle-share": Bench("bench.idle_share", "idle share at the round barrier per planner"),
    "memory": Bench("bench.memory", "peak memory of large datasets and scenes, step by step"),
    "multihost": Bench("bench.multihost.links", "PS rounds against gloo over capped links (root)"),
    "multihost-train": Bench(
        "bench.multihost.train", "training end to end on emulated hosts, PS against DDP (root)"
    ),
    "observe": Bench("bench.observe", "cost of TensorBoard events, status pages and snapshots"),
    "own-ground": Bench(
        "bench.time_to_target",
        "static, shifting and leave-return clusters: weighted-sync against every baseline",
        function="own_ground",
    ),
    "planner-speed": Bench("bench.planner_speed", "one model-planner call at 4 to 1024 workers"),
    "round-floor": Bench("bench.round_floor", "raw ZeroMQ round trip and idle cost, loopback"),
    "round-overhead": Bench("bench.round_overhead", "a weighted-sync round against a local step"),
    "round-profile": Bench("bench.round_profile", "where a round's time goes (py-spy samples)"),
    "simulate-speed": Bench("bench.simulate_speed", "simulator time for 1024 workers"),
    "tail-rounds": Bench("bench.tail_rounds", "epoch-tail rules replayed in one process"),
    "time-to-target": Bench("bench.time_to_target", "every mode on Jasper Ridge: time to target"),
    "wire": Bench(
        "bench.round_floor",
        "fused push and pull of 11.7 M values against raw ZeroMQ",
        ("--wire", "--requests", "60"),
    ),
}


RESULTS_OPTION = click.option(
    "--results",
    "results_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=RESULTS_DIR,
    show_default="bench/results",
    help="the folder of kept results",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="the result file (default bench/results/NAME.json)",
)
@click.option("--note", default="", help="conditions to state beside the figures")
@click.pass_context
def cli(ctx: click.Context, out: Path | None, note: str) -> None:
    """Run a bench and keep its result, or render docs/results.md from the kept results."""
    ctx.obj = {"out": out, "note": note}


def without_places(args: Sequence[str]) -> list[str]:
    """``args`` without the options that only say where run folders and scratch files go."""
    words = list(args)
    for i in reversed(range(len(words))):
        if words[i] in PLACE_OPTIONS:
            del words[i : i + 2]
        elif words[i].split("=", 1)[0] in PLACE_OPTIONS:
            del words[i]
    return words


def _bench_command(name: str, bench: Bench) -> click.Command:
    """A command that hands its arguments to the bench's ``main`` and records the run."""

    @click.pass_context
    def run(ctx: click.Context, args: tuple[str, ...]) -> None:
        main = getattr(importlib.import_module(bench.module), bench.function)
        command = shlex.join(["python", "-m", "bench", name, *without_places(args)])
        with recording(prog=f"python -m bench {name}") as kept:
            try:
                code = main([*bench.options, *args])
            except SystemExit as exc:  # --help, a usage error or a bench's own exit: no result
                if isinstance(exc.code, str):
                    click.echo(exc.code, err=True)
                    ctx.exit(1)
                ctx.exit(exc.code or 0)
        if code not in (None, 0):
            ctx.exit(code if isinstance(code, int) else 1)
        for option in PLACE_OPTIONS:
            kept.settings.pop(option.lstrip("-"), None)
        result = make_result(name, command, kept, note=ctx.obj["note"])
        if not result.figures:
            click.echo("no name=value figures printed: no result kept", err=True)
            return
        path = ctx.obj["out"] or RESULTS_DIR / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.to_json(), encoding="utf-8")
        click.echo(f"result: {path}", err=True)

    return click.Command(
        name,
        callback=run,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        help=f"{bench.summary.capitalize()}. Its options: python -m bench {name} --help",
        short_help=bench.summary,
        context_settings={
            "ignore_unknown_options": True,
            "allow_extra_args": True,
            "help_option_names": [],
        },
    )


for _name, _bench in BENCHES.items():
    cli.add_command(_bench_command(_name, _bench))


@cli.command(short_help="render docs/results.md and the README table from the results")
@RESULTS_OPTION
@click.option(
    "--doc",
    type=click.Path(dir_okay=False, path_type=Path),
    default=RESULTS_DOC,
    show_default="docs/results.md",
    help="the page to write",
)
@click.option(
    "--readme",
    type=click.Path(dir_okay=False, path_type=Path),
    default=README,
    show_default="README.md",
    help="the README whose results table to render",
)
@click.option("--check", is_flag=True, help="only check that the page and table are up to date")
def report(results_dir: Path, doc: Path, readme: Path, check: bool) -> None:
    """Render docs/results.md and the README's results table from the kept results."""
    pages = {
        doc: render(read_results(results_dir)),
        readme: with_readme_table(
            readme.read_text(encoding="utf-8"), readme_table(results_by_name(results_dir))
        ),
    }
    for path, text in pages.items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if check and current != text:
            raise click.ClickException(f"{path} is not what `python -m bench report` renders")
        if not check and current != text:
            path.write_text(text, encoding="utf-8")
        click.echo(f"{path}: {'up to date' if current == text else 'written'}")


@cli.command(short_help="run again what every kept result (or NAME's) records")
@click.argument("names", nargs=-1)
@RESULTS_OPTION
@click.option(
    "--timeout", type=float, default=RERUN_TIMEOUT_S, show_default=True, help="seconds per bench"
)
def rerun(names: tuple[str, ...], results_dir: Path, timeout: float) -> None:
    """Run the command of every kept result again (only those of the benches NAMES if given),
    each replacing its own result file. ``report`` renders docs/results.md afterwards
    (``make bench`` does both).

    A bench that cannot run here (root, data) keeps nothing, and its old result stays.
    """
    unknown = set(names) - set(BENCHES)
    if unknown:
        raise click.BadParameter(f"no such bench: {', '.join(sorted(unknown))}")
    for path in sorted(results_dir.glob("*.json")):
        result = Result.from_json(path.read_text(encoding="utf-8"))
        if names and result.bench not in names:
            continue
        words = shlex.split(result.command)
        if words[:4] != ["python", "-m", "bench", result.bench] or result.bench not in BENCHES:
            raise click.ClickException(f"{path}: not a python -m bench command: {result.command}")
        click.echo(f"== {path.name}: {result.command}", err=True)
        argv = [sys.executable, "-m", "bench", "--out", str(path), *words[3:]]
        try:
            done = subprocess.run(argv, cwd=ROOT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise click.ClickException(f"{path.name}: still running after {timeout:g} s") from exc
        if done.returncode != 0:
            raise click.ClickException(f"{path.name}: exit code {done.returncode}")


def main() -> None:
    """Entry point of ``python -m bench``."""
    cli(prog_name="python -m bench")
