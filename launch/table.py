"""Plain-text tables of run summaries for the terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces, with a rule under the headers."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def summary_tables(summary: dict[str, Any]) -> str:
    """A run's results and its per-worker shares as two tables."""
    final = summary.get("final") or {}
    staleness = summary.get("staleness") or {}
    run = format_table(
        [
            "mode",
            "epochs",
            "steps",
            "train s",
            "OA",
            "AA",
            "kappa",
            "best OA",
            "to target s",
            "staleness mean/max",
        ],
        [
            [
                summary["mode"],
                summary["epochs"],
                summary["steps"],
                summary["train_time_s"],
                final.get("oa"),
                final.get("aa"),
                final.get("kappa"),
                summary.get("best_oa"),
                summary.get("time_to_target_s"),
                f"{staleness['mean']:.2f}/{staleness['max']}" if staleness else "-",
            ]
        ],
    )
    workers = format_table(
        ["worker", "slowdown", "speed (samples/s)", "samples", "pushes"],
        [
            [w["name"], w["slowdown"], w["speed"], w["samples"], w["pushes"]]
            for w in summary["workers"]
        ],
    )
    return f"{run}\n\n{workers}"
