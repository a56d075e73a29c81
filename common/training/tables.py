"""Plain-text tables of run summaries for the terminal."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def natural_key(name: str) -> list[Any]:
    """Sort key that orders ``w2`` before ``w10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def oa_text(record: dict[str, Any], digits: int = 4) -> str:
    """An eval event's OA as users read it: ``OA 0.9453`` on the whole test split, ``OA*
    0.9552 on 1,072`` on a subset of it (subset scores are marked wherever they appear)."""
    oa = record.get("oa")
    text = "-" if not isinstance(oa, int | float) else f"{oa:.{digits}f}"
    if record.get("subset"):
        return f"OA* {text} on {record.get('test_samples', 0):,}"
    return f"OA {text}"


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


RUN_LEGEND = (
    "updates: model updates applied (summary.json steps); train s: training wall time, "
    "without start-up and evaluations; OA, AA, kappa: final "
    "test overall accuracy, mean per-class accuracy and Cohen's kappa; best OA: the best of "
    "any evaluation on the whole test split; to target s: training time until --target-oa "
    "was first reached; "
    "staleness: how many versions behind an async push was (mean/max)."
)
SLOWDOWN_LEGEND = "slowdown: the emulated factor (x4 = four times slower); "
WORKER_LEGEND = (
    "speed: measured compute speed; "
    "samples: training samples the worker computed; share: its part of all samples "
    "(weighted-sync gives faster workers more, equal-sync the same to all); pushes: "
    "gradients it sent (one per round in sync modes)."
)


def seconds(value: float | None) -> str:
    """Seconds to 0.1 s ("-" for None)."""
    return "-" if value is None else f"{value:.1f}"


def score(value: float | None) -> str:
    """An accuracy or kappa to 4 decimals ("-" for None)."""
    return "-" if value is None else f"{value:.4f}"


def legend(text: str, width: int = 96) -> str:
    """``text`` wrapped to ``width`` columns, as lines after a table."""
    return "\n".join(textwrap.wrap(text, width))


def summary_tables(summary: dict[str, Any]) -> str:
    """A run's results and its per-worker shares as two tables, each followed by a legend that
    defines its columns."""
    final = summary.get("final") or {}
    staleness = summary.get("staleness") or {}
    run = format_table(
        [
            "mode",
            "epochs",
            "updates",
            "train s",
            "OA",
            "AA",
            "kappa",
            "best OA",
            "to target s",
            "staleness mean/max",
            "idle share",
        ],
        [
            [
                summary["mode"],
                summary["epochs"],
                summary["steps"],
                seconds(summary["train_time_s"]),
                score(final.get("oa")),
                score(final.get("aa")),
                score(final.get("kappa")),
                score(summary.get("best_oa")),
                seconds(summary.get("time_to_target_s")),
                f"{staleness['mean']:.2f}/{staleness['max']}" if staleness else "-",
                summary.get("idle_share"),
            ]
        ],
    )
    total = sum(w["samples"] for w in summary["workers"]) or 1
    budgets = any(w.get("cpus") is not None for w in summary["workers"])
    slowed = not budgets or any(w["slowdown"] != 1 for w in summary["workers"])
    workers = format_table(
        [
            "worker",
            *(["slowdown"] if slowed else []),
            *(["CPU budget"] if budgets else []),
            *("speed (samples/s)", "samples", "share", "pushes", *MODEL_COLUMNS),
        ],
        [
            [
                w["name"],
                *([f"x{w['slowdown']:g}"] if slowed else []),
                *([budget(w)] if budgets else []),
                f"{w['speed']:.0f}",
                w["samples"],
                f"{100 * w['samples'] / total:.1f} %",
                w["pushes"],
                *model_cells(w),
            ]
            for w in sorted(summary["workers"], key=lambda w: natural_key(w["name"]))
        ],
    )
    plan = PLAN_LEGEND if summary["mode"] == "weighted-sync" else MODEL_LEGEND
    if summary["mode"] == "async":
        plan += ASYNC_SPEED_NOTE
    words = (SLOWDOWN_LEGEND if slowed else "") + (BUDGET_LEGEND if budgets else "")
    return f"{run}\n{legend(RUN_LEGEND)}\n\n{workers}\n{legend(words + WORKER_LEGEND + ' ' + plan)}"


BUDGET_LEGEND = (
    "CPU budget: the cores of the worker's emulated node, or its schedule (its budget, then "
    "VALUE@N% steps at a share of the run's work, or @Ns at seconds of training; off and on: "
    "the node left and returned). "
)


def budget(worker: dict[str, Any]) -> str:
    """A worker's CPU budget for a table: its schedule, its cores, or ``-``."""
    cpus = worker.get("cpus")
    return worker.get("schedule") or ("-" if cpus is None else f"{cpus:g}")


ASYNC_SPEED_NOTE = (
    " Speeds count compute time only (not the slowdown's sleep), measured while every process "
    "shares the same cores: a slow worker often computes while the others sleep or wait, so "
    "its speed can read higher than a faster worker's; its samples and pushes show the "
    "slowdown."
)
MODEL_COLUMNS = ("idle s", "alpha ms", "beta ms/sample", "transfer ms")
MODEL_LEGEND = (
    "idle s: time spent waiting at the round barrier (sync modes); alpha, beta, transfer: "
    "the worker's fitted round time alpha + beta*b + transfer (fixed compute cost, compute per "
    "sample, time outside compute), on which weighted-sync plans its batches."
)
PLAN_LEGEND = MODEL_LEGEND + (
    " The planner equalises these predicted times, so fixed costs (alpha, transfer) make "
    "shares differ from slowdown ratios: slow workers get less than 1/slowdown, and none if "
    "one sample would outlast the round, or if their share would shorten the round less than "
    "the wait they add: round times scatter around the predictions (summary.json "
    "details.round_spread_s), and each member of a round is one more chance that it ends late. "
    "With BatchNorm, a share below --min-local-batch (default 8) also sits out. A worker left "
    "out gets a probe now and then to keep its model fresh (one sample, or --min-local-batch)."
)


def model_cells(worker: dict[str, Any]) -> list[Any]:
    """A worker's idle seconds and fitted model (in ms), for a table."""
    model = worker.get("model") or {}

    def ms(key: str, digits: int) -> str:
        value = model.get(key)
        return "-" if value is None else f"{1000 * value:.{digits}f}"

    idle = worker.get("idle_s")
    return [
        "-" if idle is None else f"{idle:.2f}",
        ms("alpha_s", 2),
        ms("beta_s_per_sample", 4),
        ms("transfer_s", 2),
    ]


def files_written(out: Path, report: dict[str, str]) -> str:
    """The lines that end a comparison: where its files are.

    Args:
        out: the comparison's folder.
        report: ``write_report``'s paths (name -> path).

    Returns:
        One ``name: path`` line per file, ``compare.json`` and the run folders first.
    """
    lines = [f"results: {out / 'compare.json'}", f"runs: {out / 'runs'}/<mode>-<repeat>"]
    names = {"markdown": "report", "png": "figure", "svg": "figure (svg)"}
    for key, path in report.items():
        lines.append(f"{names.get(key, key.replace('_', ' '))}: {path}")
    return "\n".join(lines)
