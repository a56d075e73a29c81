"""The option reference of docs/cli.md, generated from the click commands themselves.

``python -m launch.cli_doc`` rewrites the part of docs/cli.md below ``MARKER`` with one section
per command: its first help line and a table of its options exactly as ``--help`` shows them
(metavar, help, default, environment variable). The text above the marker is written by hand.
``python -m launch.cli_doc --check`` exits non-zero when the file differs from the code.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

MARKER = "<!-- Generated below by `python -m launch.cli_doc`: edit the commands, not this part. -->"
CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def programs() -> list[tuple[str, click.Command]]:
    """The three console scripts and their click groups."""
    from launch.cli import main as pslaunch
    from pserver.cli import main as pserver
    from worker.cli import main as worker

    return [("pserver", pserver), ("worker", worker), ("pslaunch", pslaunch)]


def walk_commands(
    command: click.Command, ctx: click.Context
) -> Iterator[tuple[click.Context, click.Command]]:
    """Every runnable command below ``command`` (groups excluded), with a context for each."""
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            child = click.Context(sub, info_name=name, parent=ctx, **sub.context_settings)
            yield from walk_commands(sub, child)
    else:
        yield ctx, command


def all_commands() -> Iterator[tuple[click.Context, click.Command]]:
    """Every runnable command of the three programs (``pserver start``, ``pserver data
    prepare hsi``, …), each with a context whose ``command_path`` names it."""
    for name, root in programs():
        yield from walk_commands(root, click.Context(root, info_name=name, **root.context_settings))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_command(ctx: click.Context, command: click.Command) -> str:
    """One command's section: heading, usage, summary and options table."""
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines = [f"### `{ctx.command_path}`", "", f"`{ctx.command_path} {usage}`", ""]
    summary = (command.help or "").strip().split("\n\n")[0]
    if summary:
        lines += [" ".join(summary.split()), ""]
    rows = []
    for param in command.params:
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is not None:
            rows.append(f"| `{_cell(record[0])}` | {_cell(record[1])} |")
    if rows:
        lines += ["| option | what it does |", "|---|---|", *rows, ""]
    return "\n".join(lines)


def render() -> str:
    """The generated part of docs/cli.md (everything after the marker)."""
    sections = [render_command(ctx, command) for ctx, command in all_commands()]
    return "\n" + "\n".join(sections)


def expected(current: str) -> str:
    """``current`` (the file's text) with its generated part replaced by ``render()``.

    Raises:
        ValueError: the marker is missing.
    """
    head, found, _ = current.partition(MARKER)
    if not found:
        raise ValueError(f"{CLI_DOC} lacks the line {MARKER!r}")
    return head + MARKER + "\n" + render()


def main(argv: list[str]) -> int:
    """Rewrite docs/cli.md, or with ``--check`` report whether it is current.

    Args:
        argv: the command-line arguments (``--check`` or nothing).

    Returns:
        The exit status: 1 when ``--check`` finds the file out of date, else 0.
    """
    current = CLI_DOC.read_text(encoding="utf-8")
    wanted = expected(current)
    if "--check" in argv:
        if current != wanted:
            print(f"{CLI_DOC} is out of date: run python -m launch.cli_doc", file=sys.stderr)
            return 1
        return 0
    CLI_DOC.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
