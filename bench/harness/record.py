"""Result records: what a bench run measured, with its settings and the machine it ran on.

A bench prints its figures as ``name=value`` lines at the end of its output; a run under
``python -m bench NAME`` keeps those lines, the bench's parsed options and the facts of the
machine in one JSON file per run (``bench/results/NAME.json`` by default), which
``python -m bench report`` renders into docs/results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import datetime
import io
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

import psutil

from bench import ROOT

RESULTS_DIR = ROOT / "bench" / "results"
GIT_TIMEOUT_S = 10.0
# A figure: ``ratio_weighted_sync_vs_ddp=1.234``, a name, ``=`` and one number, alone or among
# other words of a line.
FIGURE = re.compile(r"^([A-Za-z_][\w./+-]*)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$")

_recording: contextvars.ContextVar[Recording | None] = contextvars.ContextVar(
    "bench_recording", default=None
)


@dataclasses.dataclass
class Result:
    """One bench run as stored.

    Attributes:
        bench: the bench's name (``python -m bench NAME``).
        date: when the run ended, ISO 8601 in UTC.
        command: the command line that produced the figures (where run folders went left out).
        settings: the bench's options as parsed, defaults included.
        machine: ``machine_facts()`` of the machine that ran it.
        git_commit: the code's commit (with ``+dirty`` when the checkout had changes).
        figures: the ``name=value`` lines the bench printed.
        note: conditions worth stating beside the machine (e.g. other load on it).
    """

    bench: str
    date: str
    command: str
    settings: dict[str, Any]
    machine: dict[str, Any]
    git_commit: str
    figures: dict[str, float]
    note: str = ""

    def to_json(self) -> str:
        """The record as stored: keys sorted, two-space indent, a final newline."""
        return (
            json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, ensure_ascii=False)
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> Result:
        """Read a stored record.

        Args:
            text: the file's content.

        Returns:
            The record.

        Raises:
            ValueError: the text is not a record (missing or unknown keys).
        """
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not names >= data.keys() >= names - {"note"}:
            raise ValueError(f"not a bench result: keys {sorted(data)}")
        return cls(**data)


def parse_settings(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """Parse a bench's options and keep them for the result record of the run, if one is kept.

    Args:
        parser: the bench's parser.
        argv: its arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    kept = _recording.get()
    if kept is not None:
        parser.prog = kept.prog
    args = parser.parse_args(argv)
    if kept is not None:
        kept.settings.update({k: _plain(v) for k, v in vars(args).items()})
    return args


def _plain(value: Any) -> Any:
    """A JSON-friendly form of an option's value (paths and other objects as text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def figures_in(lines: Sequence[str]) -> dict[str, float]:
    """The ``name=value`` words in a bench's output lines (a later one wins).

    Args:
        lines: what the bench printed.

    Returns:
        The figures by name.
    """
    found: dict[str, float] = {}
    for line in lines:
        for word in line.split():
            match = FIGURE.match(word)
            if match:
                found[match.group(1)] = float(match.group(2))
    return found


def machine_facts() -> dict[str, Any]:
    """CPU model, cores, load average, memory, Python and torch versions, OS of this machine."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count() or 0,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch_version,
        "system": f"{platform.system()} {platform.release()}",
    }


def _git(root: Path, *args: str) -> str:
    """The output of one git command in ``root``."""
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
    ).stdout.strip()


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit, ``+dirty`` appended when it has changes; empty without git."""
    try:
        head = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if status else "")


class _Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


@dataclasses.dataclass
class Recording:
    """What a run under ``recording`` collected: its settings and its printed lines."""

    prog: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    lines: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def recording(prog: str) -> Iterator[Recording]:
    """Collect a bench's parsed options and what it prints on stdout (still printed).

    Args:
        prog: how the bench's usage line names the command.

    Yields:
        The recording, complete when the block ends.
    """
    kept = Recording(prog)
    token = _recording.set(kept)
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield kept
    finally:
        sys.stdout = tee.stream
        _recording.reset(token)
        kept.lines = tee.copy.getvalue().splitlines()


def make_result(bench: str, command: str, kept: Recording, note: str = "") -> Result:
    """The record of a run that just ended.

    Args:
        bench: the bench's name.
        command: the command line as run.
        kept: what ``recording`` collected.
        note: conditions to state beside the figures.

    Returns:
        The record, dated now (UTC).
    """
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return Result(
        bench=bench,
        date=now.isoformat(),
        command=command,
        settings=kept.settings,
        machine=machine_facts(),
        git_commit=git_commit(),
        figures=figures_in(kept.lines),
        note=note,
    )


def results_by_name(folder: Path = RESULTS_DIR) -> dict[str, Result]:
    """Every record in ``folder`` by its file name without ``.json``.

    Args:
        folder: the results folder.

    Returns:
        The records.

    Raises:
        ValueError: a file there is not a record (its name in the message).
    """
    found = {}
    for path in sorted(folder.glob("*.json")):
        try:
            found[path.stem] = Result.from_json(path.read_text(encoding="utf-8"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
    return found


def read_results(folder: Path = RESULTS_DIR) -> list[Result]:
    """Every record in ``folder``, ordered by bench, then date, then file name.

    Raises:
        ValueError: a file there is not a record (its name in the message).
    """
    named = results_by_name(folder)
    order = sorted(named, key=lambda stem: (named[stem].bench, named[stem].date, stem))
    return [named[stem] for stem in order]
