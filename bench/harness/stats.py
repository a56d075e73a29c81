"""How the benches print a figure's spread over repeats, and pair runs of the same repeat."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from launch.report import spread

Run = dict[str, Any]


def spread_text(values: Sequence[float | None], digits: int = 3) -> str:
    """``min / median / max`` of the values that are not None ("-" when there are none)."""
    stats = spread(values)
    return "-" if stats is None else " / ".join(f"{v:.{digits}f}" for v in stats)


def paired(
    runs: list[Run], mode: str, base: str, value: Callable[[Run, Run], float | None]
) -> list[float]:
    """Per repeat where ``mode`` and ``base`` both ran without an error, ``value(mode's run,
    base's run)`` where that is not None."""
    by = {(r["mode"], r["repeat"]): r for r in runs if "error" not in r}
    found = [value(run, by[base, r]) for (m, r), run in by.items() if m == mode and (base, r) in by]
    return [v for v in found if v is not None]


def ratio(key: str) -> Callable[[Run, Run], float | None]:
    """``value`` for ``paired``: the base run's ``key`` / the run's (None unless both are set)."""
    return lambda run, base: base[key] / run[key] if run[key] and base[key] else None
