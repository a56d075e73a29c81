"""The comparison's figures: OA curves over repeats, per-worker round timelines, confusion."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt  # after choosing the backend
import numpy as np
from matplotlib.patches import Patch

from common.training.rounds import breakdown, round_events
from common.training.tables import natural_key
from launch.cluster.spec import ClusterSpec

log = logging.getLogger(__name__)

FORMATS = ("png", "svg")
TIMELINE_ROUNDS = 12
COLOURS = {"compute": "#3a6fd8", "transfer": "#e07b24", "idle": "#c9ced8"}


def _save(fig: Any, stem: Path) -> list[str]:
    """Write ``stem.png`` and ``stem.svg``; returns their paths."""
    paths = []
    for ext in FORMATS:
        path = stem.with_suffix(f".{ext}")
        fig.savefig(path, dpi=110)
        paths.append(str(path))
    plt.close(fig)
    return paths


def wrapped(text: str, fig: Any, fontsize: float) -> str:
    """``text`` wrapped to the figure's width (at most 0.62 em a character), so a title never
    leaves the canvas however narrow the figure."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.62 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def representatives(
    data: dict[str, Any], keep: Callable[[dict[str, Any]], bool] = lambda run: True
) -> dict[str, dict[str, Any]]:
    """Per mode, of its runs that ended without an error (and that ``keep``), the one whose
    epoch time is the median (the lower one for an even count); modes without such runs are
    left out."""
    out = {}
    for mode in data["settings"]["modes"]:
        runs = [r for r in data["runs"] if r["mode"] == mode and "error" not in r and keep(r)]
        if runs:
            out[mode] = sorted(runs, key=lambda r: r["epoch_time_s"] or 0.0)[(len(runs) - 1) // 2]
    return out


def settings_title(settings: dict[str, Any]) -> str:
    """One line naming what was compared: data, model, slowdowns, batch, optimizer, epochs, and
    the emulated cluster when there was one."""
    train, cluster = settings.get("train", {}), settings.get("cluster")
    slowdowns = ",".join(f"{s:g}" for s in settings.get("slowdowns", []))
    stop = (
        f"{train['epochs']} epochs"
        if train.get("epochs") is not None
        else f"{train.get('max_steps')} steps"
    )
    return (
        f"{Path(str(settings.get('dataset', '?'))).name} · {settings.get('model', '?')} · "
        f"slowdowns {slowdowns} · B={train.get('global_batch')} · {train.get('optimizer')} "
        f"lr {train.get('lr')} ({train.get('lr_schedule')}) · {stop} · seed "
        f"{train.get('seed')} · {settings.get('repeats')} repeat(s)"
        + (f" · cluster {ClusterSpec.from_description(cluster).summary_line()}" if cluster else "")
    )


def curve_points(run: dict[str, Any], key: str, initial: float | None) -> np.ndarray:
    """(x, OA) of one run's curve against ``key``, starting at x = 0 when known; the run's
    snapshots (finer, scored on the whole test split) where it has them."""
    pts = [(p[key], p["oa"]) for p in run.get("snapshot_curve") or run["curve"]]
    if pts and pts[0][0] > 0 and initial is not None:
        pts.insert(0, (0.0, initial))
    return np.array(sorted(pts), dtype=float).reshape(-1, 2)


def subset_points(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of a run's drawn curve scored on a subset of the test split (OA*)."""
    return [] if run.get("snapshot_curve") else [p for p in run.get("curve", ()) if p.get("subset")]


def median_band(curves: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Median and min–max of several curves on the union of their x values.

    Each curve counts only inside its own x range (linear interpolation between its
    points), so a repeat that ended early does not drag the others.

    Args:
        curves: arrays of (x, y) rows, x ascending.

    Returns:
        ``(x, median, low, high)``.
    """
    curves = [c for c in curves if len(c)]
    if not curves:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    grid = np.unique(np.concatenate([c[:, 0] for c in curves]))
    med, low, high = [], [], []
    for x in grid:
        ys = [np.interp(x, c[:, 0], c[:, 1]) for c in curves if c[0, 0] <= x <= c[-1, 0]]
        med.append(np.median(ys))
        low.append(min(ys))
        high.append(max(ys))
    return grid, np.array(med), np.array(low), np.array(high)


def plot_curves(data: dict[str, Any], stem: Path) -> list[str]:
    """OA against training time (left) and samples seen (right): per mode the median over
    repeats as a line, the min–max over repeats as a band, from t = 0 where the initial
    model's OA is known (``data["initial"]``).

    Args:
        data: compare.json content.
        stem: output path without suffix (``.png`` and ``.svg`` are written).

    Returns:
        The paths written.
    """
    settings = data["settings"]
    initial = (data.get("initial") or {}).get("oa")
    scheduled = scheduled_runs(data)
    mosaic: list[Any] = [["time", "samples"], *([f"budget {m}", "samples"] for m in scheduled)]
    fig, axes = plt.subplot_mosaic(
        mosaic,
        figsize=(13, 5 + 1.4 * len(scheduled)),
        height_ratios=[3.6] + [1] * len(scheduled),
        constrained_layout=True,
    )
    left, right = axes["time"], axes["samples"]
    for mode, run in scheduled.items():  # one panel of node budgets per mode, under the time axis
        axis, summary, cluster = axes[f"budget {mode}"], run["summary"], settings["cluster"]
        axis.sharex(left)
        steps = budget_steps(cluster, summary["schedule"], summary.get("train_time_s") or 0.0)
        for index, (times, cores) in enumerate(steps):
            axis.step(times, cores, where="post", label=f"node {index}", linewidth=1.4)
        top = max((max(cores) for _, cores in steps), default=1.0) or 1.0
        axis.set_ylim(0, top * 1.6)  # headroom: the legend sits above the highest budget
        axis.set_ylabel("cores", fontsize=8)
        axis.set_title(f"{mode}, repeat {run['repeat']}: CPU budget per node", fontsize=8)
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right", fontsize=7, ncols=len(cluster["workers"]))
    target = settings.get("target_oa")
    for index, mode in enumerate(settings["modes"]):
        runs = [r for r in data["runs"] if r["mode"] == mode and "error" not in r and r["curve"]]
        if not runs:
            continue
        colour = f"C{index}"
        label = f"{mode} ({len(runs)} run{'s' if len(runs) > 1 else ''})"
        for axis, key in ((left, "time_s"), (right, "samples")):
            x, med, low, high = median_band([curve_points(r, key, initial) for r in runs])
            axis.plot(x, med, color=colour, marker="o", markersize=3, label=label)
            if len(runs) > 1:
                axis.fill_between(x, low, high, color=colour, alpha=0.18, linewidth=0)
            marked = np.array([(p[key], p["oa"]) for r in runs for p in subset_points(r)])
            if len(marked):  # OA*: never mixed with whole-split scores without a mark
                axis.scatter(*marked.T, s=22, facecolors="white", edgecolors=colour, zorder=3)
    for axis, xlabel in ((left, "training time (s)"), (right, "samples seen")):
        if target is not None:
            axis.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="target OA")
        axis.set_xlim(left=0)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("test OA")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # every run failed: nothing to name
            axis.legend(loc="lower right", fontsize=8)
    snapshots = any(r.get("snapshot_curve") for r in data["runs"])
    points = "points: snapshots scored after training; " if snapshots else ""
    if any(subset_points(r) for r in data["runs"] if "error" not in r):
        points += "hollow points: OA* on a stratified subset of the test split; "
    start = (
        f"t = 0: the shared initial model, OA {initial:.3f}"
        if initial is not None
        else "no evaluation of the initial model: curves start at the first evaluation"
    )
    left.set_title("OA against training time", fontsize=10)
    right.set_title("OA against samples seen", fontsize=10)
    budgets = "; below: each node's CPU budget in the mode's median run" if scheduled else ""
    title = (
        f"{settings_title(settings)}\n{points}line: median over repeats; band: min–max; "
        f"{start}{budgets}"
    )
    fig.suptitle(wrapped(title, fig, 9), fontsize=9)
    return _save(fig, stem)


def scheduled_runs(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode whose runs recorded the schedule they applied (``summary["schedule"]``), its
    run of median epoch time; empty without an emulated cluster."""
    if not data["settings"].get("cluster"):
        return {}
    return representatives(data, lambda r: r["summary"].get("schedule") is not None)


def budget_steps(
    cluster: dict[str, Any], applied: list[dict[str, Any]], end: float
) -> list[tuple[list[float], list[float]]]:
    """Each worker node's budget over training time: per node ``(times, cores)`` for a step
    line, from its starting budget at 0 through each change ``applied`` (off = 0) to ``end``."""
    lines = []
    for index, node in enumerate(cluster["workers"]):
        times, cores = [0.0], [node["cpus"] or 0.0]
        for change in (a for a in applied if a["node"] == index):
            times.append(change["train_t"])
            cores.append(change["cores"] or 0.0)
        lines.append(([*times, max(end, times[-1])], [*cores, cores[-1]]))
    return lines


def _draw_timeline(axis: Any, rounds: list[dict[str, Any]], everyone: set[str]) -> set[str]:
    """Draw one run's rounds, one row per worker of the run (``everyone``); returns notes on
    derived quantities and on the workers that sat the rounds out."""
    shown = {part.worker for event in rounds for part in breakdown(event)}
    names = sorted(everyone | shown, key=natural_key)
    t0 = min(e["t"] - e["round_s"] for e in rounds)
    notes = set()
    if everyone - shown:
        notes.add(f"no bar: sat out these rounds ({', '.join(sorted(everyone - shown))})")
    for event in rounds:
        start = event["t"] - event["round_s"] - t0
        for part in breakdown(event):
            row = names.index(part.worker)
            at = start
            for kind, length in (
                ("compute", part.compute_s),
                ("transfer", part.transfer_s or 0.0),
                ("idle", part.idle_s),
            ):
                if length > 0:
                    axis.broken_barh(
                        [(at, length)],
                        (row - 0.38, 0.76),
                        facecolors=COLOURS[kind],
                        edgecolor="white",
                        linewidth=0.3,
                    )
                at += length
            if part.compute_estimated:
                notes.add("compute estimated as batch / speed")
            if part.transfer_s is None:
                notes.add("transfer not recorded")
            if part.idle_derived:
                notes.add(
                    "idle = round time − compute − transfer"
                    + ("" if part.transfer_s is not None else " (so it includes communication)")
                )
    axis.set_yticks(range(len(names)), names)
    axis.set_ylim(len(names) - 0.5, -0.5)
    axis.set_xlabel("time since the first round shown (s)")
    axis.grid(axis="x", alpha=0.3)
    return notes


def plot_timeline(data: dict[str, Any], stem: Path) -> list[str] | None:
    """Per sync mode, the median-speed run's rounds: compute / transfer / idle per worker.

    Args:
        data: compare.json content (each run's ``metrics.jsonl`` is read).
        stem: output path without suffix.

    Returns:
        The paths written, or None when no run has round events (async only).
    """
    panels = []
    for mode, run in representatives(data).items():
        events = round_events(Path(run["run_dir"]))
        everyone = {part.worker for event in events for part in breakdown(event)}
        start = max((len(events) - TIMELINE_ROUNDS) // 2, 0)  # the middle: past the warm-up
        rounds = events[start : start + TIMELINE_ROUNDS]
        if rounds:
            panels.append((mode, run, rounds, everyone))
    if not panels:
        log.info("timeline figure skipped: no run has sync round events")
        return None
    heights = [len(p[3]) + 1.2 for p in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(12, 0.5 * sum(heights) + 1.2),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        constrained_layout=True,
    )
    for axis, (mode, run, rounds, everyone) in zip(axes[:, 0], panels, strict=True):
        title = (
            f"{mode}, repeat {run['repeat']}: rounds {rounds[0].get('round')}–"
            f"{rounds[-1].get('round')} (median round "
            f"{1000 * float(np.median([e['round_s'] for e in rounds])):.1f} ms)"
        )
        notes = _draw_timeline(axis, rounds, everyone)
        title += "".join(f"\n{note}" for note in sorted(notes))
        axis.set_title(wrapped(title, fig, 9), fontsize=9)
    timed = any(p.transfer_s is not None for *_, rs, _ in panels for e in rs for p in breakdown(e))
    kinds = [k for k in COLOURS if k != "transfer" or timed]
    handles = [Patch(color=COLOURS[k], label=k) for k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    title = f"Per-worker round timeline · {settings_title(data['settings'])}"
    fig.suptitle(wrapped(title, fig, 9), fontsize=9)
    return _save(fig, stem)


def confusion_of(summary: dict[str, Any]) -> tuple[np.ndarray, list[str]] | None:
    """The final confusion matrix of a summary and its class names, or None if absent.

    Looks at ``per_class.confusion`` and at a top-level ``confusion``; rows are true classes.
    """
    per_class = summary.get("per_class") or {}
    matrix = per_class.get("confusion", summary.get("confusion"))
    if not isinstance(matrix, list) or not matrix:
        return None
    array = np.array(matrix, dtype=float)
    if array.ndim != 2 or array.shape[0] != array.shape[1]:
        return None
    names = per_class.get("names") or [str(i) for i in range(len(array))]
    return array, [str(n) for n in names][: len(array)]


def plot_confusion(data: dict[str, Any], stem: Path) -> list[str] | None:
    """Per mode, the median-speed run's final confusion matrix (row-normalised, counts shown).

    Args:
        data: compare.json content.
        stem: output path without suffix.

    Returns:
        The paths written, or None (with a logged reason) when no summary has the matrix.
    """
    panels = []
    for mode, run in representatives(data).items():
        found = confusion_of(run["summary"])
        if found is not None:
            panels.append((mode, *found))
    if not panels:
        log.info(
            "confusion-matrix figure skipped: no run summary carries a final confusion "
            "matrix (summary.json per_class.confusion)"
        )
        return None
    side = max(3.4, 0.42 * max(len(p[1]) for p in panels) + 1.8)
    cols = 2 if len(panels) == 4 else min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(side * cols, side * rows + 0.6),
        squeeze=False,
        constrained_layout=True,
    )
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (mode, matrix, names) in zip(axes.flat, panels, strict=False):
        rows = matrix.sum(axis=1, keepdims=True)
        share = np.divide(matrix, rows, out=np.zeros_like(matrix), where=rows > 0)
        axis.imshow(share, cmap="Blues", vmin=0, vmax=1)
        for (i, j), count in np.ndenumerate(matrix):
            axis.text(
                j,
                i,
                f"{int(count)}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if share[i, j] > 0.5 else "black",
            )
        axis.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        axis.set_yticks(range(len(names)), names, fontsize=7)
        axis.set_xlabel("predicted")
        axis.set_ylabel("true")
        axis.set_title(mode, fontsize=9)
    title = (
        "Final model, test split (colour: share of the true class; numbers: counts)\n"
        + settings_title(data["settings"])
    )
    fig.suptitle(wrapped(title, fig, 8), fontsize=8)
    return _save(fig, stem)
