"""A click group whose command list shows each command's first sentence whole, wrapped."""

from __future__ import annotations

import click

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
