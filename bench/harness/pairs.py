"""Figures of repeated runs: the paired ratio of two modes per repeat, and min / median / max."""

from __future__ import annotations

import statistics


def paired(runs: list[dict], mode: str, key: str, base: str = "ddp") -> list[float]:
    """Per repeat where both have it, ``base``'s ``key`` / ``mode``'s ``key``.

    Args:
        runs: compare.json runs (``mode``, ``repeat``, the quantity; failed ones have ``error``).
        mode, base: the two modes.
        key: the quantity, e.g. ``epoch_time_s``.

    Returns:
        The ratios, in the order of ``runs``.
    """
    by = {(r["mode"], r["repeat"]): r for r in runs if "error" not in r}
    out = []
    for (m, rep), run in by.items():
        other = by.get((base, rep))
        if m == mode and other and run[key] and other[key]:
            out.append(other[key] / run[key])
    return out


def spread_text(values: list, digits: int = 3) -> str:
    """``min / median / max`` of the values that are not None (``-`` without any)."""
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    return " / ".join(
        f"{v:.{digits}f}" for v in (min(present), statistics.median(present), max(present))
    )
