"""Per-worker slowdowns and slowdown schedules as written on the ``pslaunch`` command line."""

from __future__ import annotations

from common.config import need
from common.errors import ConfigError
from common.training.slowdown import SlowdownSchedule

SCHEDULES_HELP = (
    "Change workers' slowdowns during training. One entry per worker, separated by ';', in "
    "--slowdowns order; each entry is STEP:F[,STEP:F...] (from its local step STEP on, the "
    "worker is F times slower) or empty (keep its --slowdowns factor). Or name workers by their "
    "0-based index: '1=200:4;2=200:1'. A single entry without an index applies to every worker. "
    "Example for --slowdowns 1,1: ';100:4' makes the second worker 4x slower from step 100."
)


def parse_slowdowns(text: str, workers: int | None = None) -> tuple[float, ...]:
    """``"1,2,4"`` -> ``(1.0, 2.0, 4.0)``; a single value is repeated for ``workers`` workers.

    Args:
        text: comma-separated factors (each >= 1).
        workers: how many workers there are (default: one per factor).

    Returns:
        One factor per worker.

    Raises:
        ConfigError: ``workers`` is below 1, an entry is not a number or below 1, or the count
            does not match.
    """
    need(workers is None or workers >= 1, f"--workers must be >= 1, got {workers}")
    try:
        factors = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            f"--slowdowns {text!r} is not a comma-separated list of numbers"
        ) from None
    need(factors, "--slowdowns is empty; give at least one factor")
    need(all(f >= 1 for f in factors), f"--slowdowns must all be >= 1, got {text!r}")
    count = workers or len(factors)
    if len(factors) == 1:
        factors *= count
    need(
        len(factors) == count,
        f"--slowdowns {text!r} has {len(factors)} entries for {count} workers",
    )
    return factors


def parse_schedules(text: str, slowdowns: tuple[float, ...]) -> tuple[str, ...]:
    """Split ``--slowdown-schedules`` into one ``STEP:F,...`` string per worker.

    Args:
        text: the option's value (see ``SCHEDULES_HELP``); empty means no changes.
        slowdowns: every worker's initial factor (fixes the number of workers).

    Returns:
        One schedule per worker ("" for none), or ``()`` when ``text`` is empty.

    Raises:
        ConfigError: a malformed entry, an index out of range, a repeated index, a mix of
            indexed and positional entries, or the wrong number of positional entries.
    """
    if not text.strip():
        return ()
    entries = [e.strip() for e in text.split(";")]
    count = len(slowdowns)
    indexed = [e for e in entries if "=" in e]
    if indexed and len(indexed) != len([e for e in entries if e]):
        raise ConfigError(
            f"--slowdown-schedules {text!r} mixes 'INDEX=' entries with positional ones"
        )
    schedules = [""] * count
    if indexed:
        for entry in indexed:
            index, _, spec = entry.partition("=")
            try:
                i = int(index)
            except ValueError:
                raise ConfigError(
                    f"--slowdown-schedules entry {entry!r}: {index!r} is not an index"
                ) from None
            need(
                0 <= i < count,
                f"--slowdown-schedules entry {entry!r}: worker index {i} is not in [0, {count})",
            )
            need(not schedules[i], f"--slowdown-schedules names worker {i} twice")
            schedules[i] = spec.strip()
    elif len(entries) == 1:
        schedules = entries * count
    elif len(entries) == count:
        schedules = entries
    else:
        raise ConfigError(
            f"--slowdown-schedules {text!r} has {len(entries)} entries for {count} workers "
            "(give one per worker, separated by ';', or use INDEX=STEP:F)"
        )
    for factor, spec in zip(slowdowns, schedules, strict=True):
        SlowdownSchedule(factor, spec)  # raises ConfigError on a malformed entry
    return tuple(schedules)
