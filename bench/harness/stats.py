"""How the benches print a figure's spread over repeats."""

from __future__ import annotations

from collections.abc import Sequence

from launch.report import spread


def spread_text(values: Sequence[float | None], digits: int = 3) -> str:
    """``min / median / max`` of the values that are not None ("-" when there are none)."""
    stats = spread(values)
    return "-" if stats is None else " / ".join(f"{v:.{digits}f}" for v in stats)
