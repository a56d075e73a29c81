"""Environment variables for command-line options: one naming scheme, shown by every ``--help``.

The names are click's ``auto_envvar_prefix`` names: the program (``PSERVER``, ``WORKER``,
``PSLAUNCH``), each subcommand, then the option, upper case with ``-`` as ``_``:
``pserver start --mode`` is ``PSERVER_START_MODE``, ``pserver data prepare hsi --cube`` is
``PSERVER_DATA_PREPARE_HSI_CUBE``, ``pslaunch local --workers`` is ``PSLAUNCH_LOCAL_WORKERS``.
There are no short aliases (``PSERVER_MODE`` sets nothing). A variable applies only to the
command it names: launchers start their children without any of them (``child_environment``).
"""

from __future__ import annotations

from collections.abc import Mapping

import click


def walk_options(
    command: click.Command, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Option]]:
    """Every option of ``command`` and its subcommands, each with its command's path."""
    found = [(path, p) for p in command.params if isinstance(p, click.Option)]
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            found += walk_options(sub, (*path, name))
    return found


def show_envvars(command: click.Command) -> None:
    """Make every option of ``command`` and its subcommands show its variable in ``--help``."""
    for _, option in walk_options(command):
        option.show_envvar = True


PROGRAMS = ("PSERVER", "WORKER", "PSLAUNCH")
# Not options: variables of the same prefix that every process of a run should see.
PASSED_ON = ("PSERVER_STAGE_TRACE",)


def child_environment(environ: Mapping[str, str], **extra: str) -> dict[str, str]:
    """The environment for a process a launcher starts: ``environ`` without any variable of
    this scheme, so a variable set for one command (``PSERVER_START_OVERWRITE=1`` for a
    ``pserver start``) cannot change the children of another; the launcher passes what it
    means as options. ``PASSED_ON`` variables (the stage trace) do reach the children.

    Args:
        environ: the launcher's environment (``os.environ``).
        extra: variables to set in the children.

    Returns:
        The children's environment.
    """
    prefixes = tuple(f"{program}_" for program in PROGRAMS)
    kept = {
        name: value
        for name, value in environ.items()
        if not name.startswith(prefixes) or name in PASSED_ON
    }
    return {**kept, **extra}
