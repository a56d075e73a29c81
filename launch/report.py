"""The comparison report: report.md (tables over repeats) and its figures (launch/figures.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.training.rounds import TAIL, TAIL_LIMIT
from common.training.tables import natural_key
from launch import figures
from launch.cluster.spec import PRESETS, ClusterSpec
from launch.procs import new_events

RESULT_COLUMNS = (
    "mode",
    "runs",
    "epoch time s",
    "median round ms",
    "throughput samples/s",
    "time to target s",
    "max OA drop",
    "final OA",
    "final AA",
    "final kappa",
    "idle share",
    "restarts",
)
RESTART_KEYS = ("restarts", "worker_restarts", "versions_replayed", "lost_samples", "restart_s")


def spread(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    """(min, median, max) of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return min(present), statistics.median(present), max(present)


def _cell(stats: tuple[float, float, float] | None, digits: int, reached: str = "") -> str:
    if stats is None:
        return "-" if not reached else f"- {reached}"
    lo, mid, hi = stats
    text = f"{lo:.{digits}f} / {mid:.{digits}f} / {hi:.{digits}f}"
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":  # one repeat, or repeats that agree
        text = f"{mid:.{digits}f}"
    return f"{text} {reached}" if reached else text


def aggregate(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode, the (min, median, max) over repeats of every reported quantity.

    Args:
        data: compare.json content (``settings`` and ``runs``).

    Returns:
        mode -> ``{"runs", "failed", "reached", "epoch_time_s", "round_ms", "carried",
        "time_to_target_s", "max_drop", "oa", "aa", "kappa", "idle_share"}``, each quantity a
        (min, median, max) tuple or None (idle share: sync modes only; median round: modes
        with rounds); ``carried``: the runs whose slowest 2 % of rounds made more than 20 % of
        their round time.
    """
    out: dict[str, dict[str, Any]] = {}
    for mode in data["settings"]["modes"]:
        runs = [r for r in data["runs"] if r["mode"] == mode]
        ok = [r for r in runs if "error" not in r]
        finals = [r["summary"].get("final") or {} for r in ok]
        out[mode] = {
            "runs": len(ok),
            "failed": len(runs) - len(ok),
            "reached": sum(r["time_to_target_s"] is not None for r in ok),
            "epoch_time_s": spread([r["epoch_time_s"] for r in ok]),
            "round_ms": spread([1000 * r["round_median_s"] for r in ok if r.get("round_median_s")]),
            "carried": [r for r in ok if (r.get("tail_share") or 0) > TAIL_LIMIT],
            "throughput": spread([throughput(r["summary"]) for r in ok]),
            "time_to_target_s": spread([r["time_to_target_s"] for r in ok]),
            "max_drop": spread([r.get("max_drop") for r in ok]),
            **{k: spread([f.get(k) for f in finals]) for k in ("oa", "aa", "kappa")},
            "idle_share": spread([r["summary"].get("idle_share") for r in ok]),
            "restarts": restarts_cell([r["summary"] for r in ok]),
        }
    return out


def restarts_cell(summaries: list[dict[str, Any]]) -> str:
    """The restarts of a mode's runs, summed: of the server, of workers, and the versions the
    resumed servers made again; for DDP, of the group, the samples it threw away and the
    restart time; ``-`` when nothing was restarted."""
    total = {k: sum(s.get(k) or 0 for s in summaries) for k in RESTART_KEYS}
    if not total["restarts"] and not total["worker_restarts"]:
        return "-"
    if any("lost_samples" in s for s in summaries):
        return (
            f"group {total['restarts']}, samples lost {total['lost_samples']}, "
            f"{total['restart_s']:.1f} s"
        )
    return (
        f"server {total['restarts']}, workers {total['worker_restarts']}, "
        f"versions replayed {total['versions_replayed']}"
    )


def throughput(summary: dict[str, Any]) -> float | None:
    """Training samples per second of training time (``samples_seen / train_time_s``)."""
    samples, seconds = summary.get("samples_seen"), summary.get("train_time_s")
    if not isinstance(samples, int | float) or not isinstance(seconds, int | float):
        return None
    return samples / seconds if seconds > 0 else None


def speedup_section(stats: dict[str, dict[str, Any]], target: float | None) -> list[str]:
    """The speed-up table, with a column only for baselines that ran (and time to target only
    with a target); a sentence instead when no baseline ran."""
    columns = []
    for key, name in (("epoch_time_s", "epoch time"), ("time_to_target_s", "time to target")):
        for base in ("ddp", "weighted-ddp", "equal-sync"):
            if base in stats and (key == "epoch_time_s" or target is not None):
                columns.append((key, base, f"{name} vs {base}"))
    heading = "## Speed-up (median of the baseline / median of the mode; > 1 is faster)"
    if not columns:
        return [heading, "", "No baseline ran (ddp or equal-sync), so there is no speed-up.", ""]
    rows = []
    for mode in stats:
        row = [mode]
        for key, base, _ in columns:
            value = speedup(stats, mode, base, key)
            row.append("-" if value is None else f"{value:.2f}x")
        rows.append(row)
    return [heading, "", _table(["mode", *(c[2] for c in columns)], rows), ""]


def speedup(stats: dict[str, dict[str, Any]], mode: str, base: str, key: str) -> float | None:
    """Median of ``base`` over median of ``mode`` for ``key`` (> 1: ``mode`` is faster)."""
    if base not in stats or stats[mode][key] is None or stats[base][key] is None:
        return None
    mine, theirs = stats[mode][key][1], stats[base][key][1]
    return theirs / mine if mine > 0 else None


def _table(headers: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: settings, the results table and the speed-up table."""
    settings = data["settings"]
    stats = aggregate(data)
    target = settings.get("target_oa")
    train = settings["train"]
    slowdowns = ", ".join(f"{s:g}" for s in settings["slowdowns"])
    results = []
    for mode, s in stats.items():
        runs = f"{s['runs']}" + (f" ({s['failed']} failed)" if s["failed"] else "")
        reached = f"({s['reached']}/{s['runs']} reached)" if target is not None else ""
        results.append(
            [
                mode,
                runs,
                _cell(s["epoch_time_s"], 3) + (" †" if s["carried"] else ""),
                _cell(s["round_ms"], 1),
                _cell(s["throughput"], 0),
                _cell(s["time_to_target_s"], 2, reached) if target is not None else "-",
                _cell(s["max_drop"], 3),
                _cell(s["oa"], 4),
                _cell(s["aa"], 4),
                _cell(s["kappa"], 4),
                _cell(s["idle_share"], 3),
                s["restarts"],
            ]
        )
    used = [i for i in range(len(RESULT_COLUMNS)) if i < 2 or any(r[i] != "-" for r in results)]
    headers, results = [RESULT_COLUMNS[i] for i in used], [[r[i] for i in used] for r in results]
    limits = [f"epochs {train['epochs']}"] if train.get("epochs") is not None else []
    if train.get("max_steps") is not None:
        limits.append(f"max steps {train['max_steps']}")
    repeats, schedules = settings["repeats"], settings["slowdown_schedules"]
    stopped = []
    if "stopped" in data:
        stopped.append(f"- **stopped {data['stopped']}**: `--resume` runs the rest")
    lines = [
        "# Comparison of training modes",
        "",
        f"- dataset: `{settings['dataset']}`, model: `{settings['model']}`",
        f"- slowdowns: {slowdowns}" + (f"; schedules: {schedules}" if schedules else ""),
        f"- global batch {train['global_batch']}, {train['optimizer']} lr {train['lr']} "
        f"({train['lr_schedule']}), {', '.join(limits)}, seed {train['seed']}, "
        f"repeats {repeats}",
        f"- target OA: {target if target is not None else 'none'}",
        *stopped,
        *option_lines(settings),
        *cluster_lines(settings.get("cluster")),
        *kept_lines(data),
        "",
        *setup_section(data),
        (
            "Each cell is min / median / max over repeats (one value where they agree). "
            if repeats > 1
            else "One repeat per mode. "
        )
        + "Epoch time = train_time_s / epochs (start-up and blocking evaluation excluded; † "
        "where a few rounds carry it, see below); median round = the median of the run's round "
        "times (DDP: steps; none in async); "
        "throughput = training samples / train_time_s; " + target_source(data) + " Idle share = "
        "the workers' time waiting at the round barrier over their round time (sync modes). "
        "Max OA drop = the largest fall of a snapshot's (or evaluation's) OA below the best "
        "OA so far, after the first epoch: how far the curve falls back once it has risen. "
        "Epoch tails: an epoch's last step, over the n mod B samples left, is weighted b / B "
        "(gradient and BatchNorm statistics) in every mode, parameter server and DDP alike. "
        "Restarts = processes the launcher started again after they died, over the mode's "
        "runs, and the versions the resumed servers made again; for DDP, the group restarts "
        "from its last checkpoint when a node leaves and when it returns: the samples applied "
        "since that checkpoint are lost, and the restart time (failure to the next group's "
        "first step) counts as training time. "
        "Columns no run could fill are left out." + subset_note(data),
        "",
        "## Results",
        "",
        _table(headers, results),
        "",
        *carried_lines(stats),
        *speedup_section(stats, target),
        *schedule_section(data),
        *per_class_section(data),
        "![OA against training time and samples seen](report.png)",
        "",
    ]
    return "\n".join(lines)


def schedule_section(data: dict[str, Any]) -> list[str]:
    """When each mode's runs met each change of the nodes' schedules (``summary["schedule"]``):
    the training time, min / median / max over repeats; no lines without schedules."""
    met: dict[str, dict[str, list[float]]] = {}
    for run in data["runs"]:
        for change in (run.get("summary") or {}).get("schedule") or ():
            name = f"node {change['node']}: {change['change']}"
            met.setdefault(name, {}).setdefault(run["mode"], []).append(change["train_t"])
    modes = [m for m in data["settings"]["modes"] if any(m in by for by in met.values())]
    if not modes:
        return []
    rows = [[m, *(_cell(spread(by.get(m, [])), 1) for by in met.values())] for m in modes]
    return [
        "## Schedule as applied (training time in s at each change; min / median / max)",
        "",
        _table(["mode", *met], rows),
        "",
    ]


def subset_note(data: dict[str, Any]) -> str:
    """The sentence marking in-run scores on a subset of the test split (OA*), if any."""
    runs = [r for r in data["runs"] if "error" not in r]
    sizes = sorted({p["subset"] for r in runs for p in figures.subset_points(r)})
    if not sizes:
        return ""
    return (
        f" OA*: in-run evaluations scored on a stratified subset of the test split (of "
        f"{', '.join(f'{n:,}' for n in sizes)} samples; hollow points in report.png), so time "
        "to target and max OA drop may rest on them; final scores use the whole split."
    )


def carried_lines(stats: dict[str, dict[str, Any]]) -> list[str]:
    """The note under the results for epoch times marked † (a few rounds carry them)."""
    runs = [r for s in stats.values() for r in s["carried"]]
    if not runs:
        return []
    named = ", ".join(
        f"{r['mode']} #{r['repeat']} ({100 * r['tail_share']:.0f} %, the longest round "
        f"{1000 * r['round_slowest_s']:.0f} ms against a median of "
        f"{1000 * r['round_median_s']:.1f} ms)"
        for r in runs
    )
    return [
        f"† carried by a few rounds: the slowest {100 * TAIL:.0f} % of the rounds made more "
        f"than {100 * TAIL_LIMIT:.0f} % of the round time in {named}; a load spike or a stall "
        "can make such an epoch time, so compare the median rounds (and repeat the runs).",
        "",
    ]


def setup_section(data: dict[str, Any]) -> list[str]:
    """The setup block: the machine and torch (``settings.setup``, from ``collect_setup``),
    the device each worker joined with and the host it joined from (the runs' ``join``
    events); no lines when there is nothing to say. The emulated cluster is in the settings
    above it, from ``cluster_lines``."""
    setup = data["settings"].get("setup")
    run_dirs = [r["run_dir"] for r in data["runs"] if r.get("run_dir")]
    devices, hosts = worker_values(run_dirs, "device", "?"), worker_values(run_dirs, "host")
    lines = []
    if setup:
        gpus = ", ".join(setup.get("gpus") or []) or "none"
        lines += [
            f"- host: `{setup.get('host')}` ({setup.get('os')}); CPU: {setup.get('cpu')}, "
            f"{setup.get('cpus')} logical CPUs usable; GPUs: {gpus}",
            f"- torch {setup.get('torch')}, Python {setup.get('python')}",
        ]
    if devices:
        lines.append("- workers' devices: " + _grouped(devices))
    if hosts:
        lines.append("- workers' hosts: " + _grouped(hosts, "`"))
    return ["## Setup", "", *lines, ""] if lines else []


def worker_values(run_dirs: Sequence[str | Path], key: str, missing: str = "") -> dict[str, str]:
    """What each worker said of itself at join (``device``, ``host``), from the ``join``
    events of the runs' ``metrics.jsonl``.

    Args:
        run_dirs: run directories (missing files are skipped).
        key: the ``join`` event's field.
        missing: the value of a worker that did not say ("": the worker is left out).

    Returns:
        worker name -> value (the first join's), sorted by name (``w2`` before ``w10``).
    """
    found: dict[str, str] = {}
    events = [e for d in run_dirs for e in new_events(Path(d) / "metrics.jsonl", 0)]
    for event in (e for e in events if e.get("event") == "join" and e.get("worker")):
        value = event.get(key)
        if (isinstance(value, str) and value) or missing:
            found.setdefault(str(event["worker"]), str(value or missing))
    return {name: found[name] for name in sorted(found, key=natural_key)}


def _grouped(values: dict[str, str], quote: str = "") -> str:
    """``a: w1, w2; b: w3`` from worker name -> value, values in order of first appearance."""
    by_value: dict[str, list[str]] = {}
    for name, value in values.items():
        by_value.setdefault(value, []).append(name)
    return "; ".join(
        f"{quote}{_shown(value)}{quote}: {', '.join(map(_shown, names))}"
        for value, names in by_value.items()
    )


def _shown(text: str) -> str:
    """``text`` as Markdown shows it literally on one line: printable characters only (at most
    64), no backquote or table bar, HTML's ``&<>`` as entities."""
    kept = "".join(c for c in text[:64] if c.isprintable() and c not in "`|")
    return kept.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def option_lines(settings: dict[str, Any]) -> list[str]:
    """The extra ``pserver start`` and ``worker join`` options the parameter-server runs had."""
    return [
        f"- extra {program} options (parameter-server runs): `{' '.join(options)}`"
        for program, options in (
            ("pserver start", settings.get("server_options") or ()),
            ("worker join", settings.get("worker_options") or ()),
        )
        if options
    ]


def cluster_lines(described: dict[str, Any] | None) -> list[str]:
    """The report's lines on the cluster the runs emulated (``ClusterSpec.describe``), the
    preset in full; a line saying the processes shared the machine's cores when none."""
    if described is None:
        return [
            "- cluster: none emulated: every process shared this machine's cores "
            "(oversubscribed; the comparison measures the cores as much as the modes)"
        ]
    spec = ClusterSpec.from_description(described)
    lines = [f"- emulated cluster: {spec.summary_line()}"]
    preset = PRESETS.get(spec.name or "")
    if preset is not None:
        lines.append(f"  (preset {spec.name}: {preset.description})")
    if spec.scheduled:
        nodes = [(i, n.get("schedule")) for i, n in enumerate(described["workers"])]
        lines.append(
            "  schedules (a budget, then VALUE@N% of the run's work or VALUE@Ns of training; "
            "off/on: the node leaves and returns): "
            + "; ".join(f"node {i}: `{text}`" for i, text in nodes if text)
        )
    lines.append(
        "  each worker, DDP rank, the server and each shard ran in its own CPU-quota control "
        "group; DDP ranks had the budgets of the workers they stand for"
    )
    return lines


def kept_lines(data: dict[str, Any]) -> list[str]:
    """The line naming the nodes each ``ddp-kept`` run had (none without such runs)."""
    kept = [
        f"repeat {r['repeat']}: {', '.join(str(i) for i in r['kept_nodes'])}"
        for r in data["runs"]
        if "kept_nodes" in r
    ]
    if not kept:
        return []
    return [
        "- ddp-kept: plain DDP on the nodes (by index) that computed >= 5 % of the samples "
        f"of the same repeat's weighted-sync run: {'; '.join(kept)}"
    ]


def target_source(data: dict[str, Any]) -> str:
    """The sentence saying where each mode's time to target came from."""
    sources: dict[str, set[str]] = {}
    for run in data["runs"]:
        if "error" not in run:
            source = run.get("time_to_target_source", "evaluations")
            if source == "snapshots":
                source = f"snapshots every {run['snapshot_every']} updates"
            sources.setdefault(run["mode"], set()).add(source)
    snapshots = (
        "training time at which the first snapshot with OA at or above the target was "
        "produced (snapshots kept at a fixed interval of updates, scored after training on "
        "the whole test split; async snapshots every N x workers pushes, about as many "
        "samples apart as N rounds)"
    )
    evaluations = (
        "training time of the first evaluation (after each epoch) with OA at or above the target"
    )
    kinds = {s.split(" ")[0] for found in sources.values() for s in found}
    if kinds == {"evaluations"} or not kinds:
        return f"time to target = {evaluations}."
    per_mode = "; ".join(f"{m}: {', '.join(sorted(s))}" for m, s in sources.items())
    text = f"time to target = {snapshots}"
    if "evaluations" in kinds:
        text += f", or where there are none, {evaluations}"
    return f"{text}. Source per mode: {per_mode}."


def per_class_section(data: dict[str, Any]) -> list[str]:
    """Markdown lines of the per-class accuracy table: one row per mode, one column per class.

    Each cell is the median over the mode's repeats of the class's test accuracy in the
    final evaluation, with the min-max range when repeats differ; ``-`` where no run reported
    the class.

    Args:
        data: compare.json content.

    Returns:
        The section's lines (empty when no run's summary has ``per_class``).
    """
    first: dict[str, Any] = {}  # the first mode's first run names the classes
    rows = []
    for mode in data["settings"]["modes"]:
        found = [
            r["summary"]["per_class"]
            for r in data["runs"]
            if r["mode"] == mode and "error" not in r and (r.get("summary") or {}).get("per_class")
        ]
        if not found:
            continue
        first = first or found[0]
        row = [mode]
        for k in range(len(first["names"])):
            stats = spread([p["accuracy"][k] for p in found if k < len(p["accuracy"])])
            cell = "-" if stats is None else f"{stats[1]:.3f}"
            if stats is not None and stats[0] != stats[2]:
                cell += f" ({stats[0]:.3f}-{stats[2]:.3f})"
            row.append(cell)
        rows.append(row)
    if not rows:
        return []
    names, support = first["names"], first["support"]
    headers = ["mode", *(f"{n} (n={s})" for n, s in zip(names, support, strict=False))]
    return [
        "## Per-class accuracy (final evaluation, median over repeats, min-max in brackets)",
        "",
        _table(headers, rows),
        "",
    ]


def write_report(data: dict[str, Any], out: Path) -> dict[str, str]:
    """Write ``report.md``, ``report.png``/``.svg`` and the timeline and confusion figures.

    Args:
        data: compare.json content.
        out: the output directory.

    Returns:
        The paths written, as ``{"markdown", "png", "svg"}`` plus ``timeline_png``,
        ``timeline_svg``, ``confusion_png``, ``confusion_svg`` for the figures there was
        data for (sync round events; a final confusion matrix in the summaries).
    """
    markdown = out / "report.md"
    markdown.write_text(render_markdown(data), encoding="utf-8")
    paths = {"markdown": str(markdown)}
    paths["png"], paths["svg"] = figures.plot_curves(data, out / "report")
    for name, draw in (("timeline", figures.plot_timeline), ("confusion", figures.plot_confusion)):
        written = draw(data, out / name)
        if written:
            paths[f"{name}_png"], paths[f"{name}_svg"] = written
    return paths
