"""Real parts some tests need (data, a browser, Slurm, network namespaces, control groups, a
sampling profiler, a tmpfs mount).

A test whose part is missing skips with the reason, or fails when the run requires that part:
``pytest --require data,browser,slurm,netns,cgroup,profiler,tmpfs`` (what ``.ci/run`` passes). The
variables ``REQUIRE_REAL_DATA=1``, ``REQUIRE_BROWSER=1``, ``REQUIRE_SLURM=1``,
``REQUIRE_NETNS=1``, ``REQUIRE_CGROUP=1``, ``REQUIRE_PROFILER=1`` and ``REQUIRE_TMPFS=1``
require the same parts.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

PARTS = {
    "data": "REQUIRE_REAL_DATA",
    "browser": "REQUIRE_BROWSER",
    "slurm": "REQUIRE_SLURM",
    "netns": "REQUIRE_NETNS",
    "cgroup": "REQUIRE_CGROUP",
    "profiler": "REQUIRE_PROFILER",
    "tmpfs": "REQUIRE_TMPFS",
}
_REQUIRED = pytest.StashKey[frozenset[str]]()


def add_option(parser: pytest.Parser) -> None:
    """Register ``--require``."""
    parser.addoption(
        "--require",
        default="",
        metavar="PARTS",
        help=(
            "comma-separated real parts whose absence fails the tests that need them instead "
            f"of skipping them: {', '.join(PARTS)}"
        ),
    )


def parse_parts(text: str) -> frozenset[str]:
    """The parts named in ``--require``'s value.

    Raises:
        pytest.UsageError: a name is not one of ``PARTS``.
    """
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - PARTS.keys())
    if unknown:
        raise pytest.UsageError(
            f"--require: unknown part {', '.join(unknown)}; the parts are {', '.join(PARTS)}"
        )
    return frozenset(names)


def configure(config: pytest.Config) -> None:
    """Record the required parts: those of ``--require`` and of the ``REQUIRE_*`` variables."""
    from_env = {part for part, variable in PARTS.items() if os.environ.get(variable) == "1"}
    config.stash[_REQUIRED] = parse_parts(config.getoption("--require")) | from_env


def is_required(config: pytest.Config, part: str) -> bool:
    """Whether this run requires ``part``."""
    return part in config.stash[_REQUIRED]


def missing(config: pytest.Config, part: str, reason: str) -> NoReturn:
    """Skip the test for want of ``part``, or fail it when the run requires ``part``."""
    if is_required(config, part):
        pytest.fail(f"{reason} (--require {part} requires it)")
    pytest.skip(reason)
