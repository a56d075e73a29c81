"""Click helpers: a group listing each command's whole first sentence, an output-file type
checked before any work is done, and options typed and defaulted by a config field."""

from __future__ import annotations

import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.config import default, flag

SHORT_HELP_CHARS = 200  # click's default cuts at the terminal width with "..."


class FullHelpGroup(click.Group):
    """``--help`` lists subcommands with their whole first sentence (wrapped, never cut)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the command list like click does, without truncating the summaries."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            rows.append((name, cmd.get_short_help_str(limit=SHORT_HELP_CHARS)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class OutFile(click.Path):
    """A file to write: its folder must exist and be writable when the options are parsed,
    so a command that works for minutes never fails at the end on its output path."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        folder = Path(os.fsdecode(path)).parent
        if not folder.is_dir():
            self.fail(f"the folder {str(folder)!r} does not exist", param, ctx)
        if not os.access(folder, os.W_OK | os.X_OK):
            self.fail(f"the folder {str(folder)!r} is not writable", param, ctx)
        return path


def config_option(name: str, cls: type, **kwargs: Any) -> Callable[[Any], Any]:
    """A click option for field ``name`` of the config dataclass ``cls``, with its default and,
    for an ``int`` or ``float`` field (or one that may be None), its type.

    Args:
        name: the field (and the option's parameter name).
        cls: the config dataclass.
        kwargs: click.option's other arguments (a ``type`` given here wins); ``flag`` overrides
            the option's flags (``--`` and ``flag(name)``).

    Returns:
        The option decorator.
    """
    flags = kwargs.pop("flag", "--" + flag(name))
    kind = typing.get_type_hints(cls)[name]
    kwargs.setdefault("type", next((t for t in (int, float) if kind in (t, t | None)), None))
    return click.option(flags, name, default=default(cls, name), **kwargs)
