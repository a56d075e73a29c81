"""docs/results.md and the README's results table, rendered from the kept bench results.

The page shows, per bench, the newest result of each command: the command, one line of when
and on what machine it ran, and the figures as the bench printed them. It is a function of the
records alone (sorted, numbers formatted one way), so the same records give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

from bench import ROOT
from bench.harness.record import Result

RESULTS_DOC = ROOT / "docs" / "results.md"

HEADER = """\
# Results

<!-- Rendered by `python -m bench report` from bench/results/*.json: edit those, not this page. -->

The figures the benches kept, the newest for each command. What a bench measures and what its
figures mean is in [benchmarks.md](benchmarks.md); terms are in the [glossary](glossary.md).
Absolute times drift on a shared machine; ratios are measured side by side in one run. On an
*emulated cluster* every node has its own CPU budget; on *shared cores* (oversubscribed) every
process competes for the same cores.
"""

# How the machine line names each fact, in this order; other keys follow, sorted.
MACHINE_LABELS = {
    "cpu_model": "{}",
    "cores": "{} cores",
    "memory_gib": "{} GiB",
    "load_average": "load average {}",
    "python": "Python {}",
    "torch": "torch {}",
    "system": "{}",
}
# The benches the README and the choice of a mode rest on come first; the rest by name.
LEADING = ("own-ground", "time-to-target", "idle-share", "ddp-fidelity", "multihost")


def _number(value: float) -> str:
    """One way to print a figure: integers as such, others with up to 6 significant digits."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"


def _cell(value: Any) -> str:
    text = _number(value) if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table's lines, a ``|`` in a cell escaped.

    Args:
        columns: the header cells.
        rows: the rows' cells (floats as ``_number`` prints them).

    Returns:
        The header line, the rule and a line per row.
    """
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _machine(machine: dict[str, Any]) -> str:
    """The machine's facts in a fixed order, then any others sorted."""
    parts = []
    for key in [*MACHINE_LABELS, *sorted(set(machine) - set(MACHINE_LABELS))]:
        if key not in machine or machine[key] in ("", None, []):
            continue
        value = machine[key]
        if isinstance(value, list):
            value = " / ".join(_cell(v) for v in value)
        label = MACHINE_LABELS.get(key, f"{key.replace('_', ' ')} {{}}")
        parts.append(label.format(_cell(value)))
    return "; ".join(parts)


def _bench_order(result: Result) -> tuple[int, str]:
    """Where a bench's section goes: the leading ones in their order, then by name."""
    if result.bench in LEADING:
        return LEADING.index(result.bench), ""
    return len(LEADING), result.bench


def _date(iso: str) -> str:
    """``2026-11-26 00:45 UTC`` for a recorded time, a date alone as it is."""
    day, _, time = iso.partition("T")
    return f"{day} {time[:5]} UTC" if time else day


def newest(results: Sequence[Result]) -> list[Result]:
    """The newest result of each bench and command, in the order of ``results``."""
    latest = {(r.bench, r.command): r for r in sorted(results, key=lambda r: r.date)}
    return [r for r in results if latest[(r.bench, r.command)] is r]


def render_result(result: Result) -> list[str]:
    """The lines of one result: its command, when and on what machine it ran, its figures."""
    where = "; ".join(part for part in (_machine(result.machine), result.note) if part)
    figures = (f"`{name}={_number(result.figures[name])}`" for name in sorted(result.figures))
    return [f"### `{result.command}`", "", f"{_date(result.date)}: {where}", "", " ".join(figures)]


def render(results: Sequence[Result]) -> str:
    """The whole page for ``results``: per bench, the newest result of each command.

    Args:
        results: the kept records, each bench's in date order (as ``read_results`` gives them).

    Returns:
        The Markdown text, ending in one newline.
    """
    lines = [HEADER.rstrip("\n")]
    ordered = sorted(newest(results), key=_bench_order)  # stable: dates stay in order
    for bench, group in groupby(ordered, key=lambda r: r.bench):
        lines += ["", f"## {bench}"]
        for result in group:
            lines += ["", *render_result(result)]
    return "\n".join(lines) + "\n"


README = ROOT / "README.md"
README_START = "<!-- results table: rendered by `python -m bench report` from bench/results/ -->"
README_END = "<!-- end of the results table -->"
# The README's table: which kept result fills each row, its regime, and how the row names the
# cluster and the regime. A row whose result is not kept is left out until a run keeps it.
README_ROWS = (
    (
        "time-to-target-cluster-small",
        "small",
        "`small-1124`",
        "small: 5×5 patches, 10 % train, B=64, target 0.90",
    ),
    (
        "time-to-target-cluster-heavy",
        "heavy",
        "`small-1124`",
        "heavy: 11×11, 50 % train, B=128, target 0.84; samples pulled from the server",
    ),
    (
        "time-to-target-cluster-heavy-local-data",
        "heavy",
        "`small-1124`",
        "heavy, workers read a local copy (`--worker-data`) as DDP's ranks do",
    ),
    ("time-to-target-cluster-wide", "heavy", "`wide-70-25-5`", "heavy"),
)
README_COLUMNS = (
    "cluster (preset)",
    "regime",
    "epoch time vs DDP",
    "time to target vs DDP",
    "final OA, ws / DDP",
    "max OA drop, ws / DDP",
    "measured",
)


def _pair(figures: dict[str, float], first: str, second: str) -> str:
    if first not in figures or second not in figures:
        return "–"
    return f"{figures[first]:.3f} / {figures[second]:.3f}"


def _load(load: list[float] | None) -> str:
    """A load average in a few words: its 1-minute figure."""
    return _cell(float(load[0])) if load else "not recorded"


README_NOTE = (
    "A ratio can exceed the linear ideal of the budgets (their sum over the slowest node's "
    "times the node count: 2.75× for `small-1124`): the slowest DDP rank pays its fixed "
    "per-step cost at a tenth of a core on every step, while the planner sits that node out. "
    "The figures need a quiet machine: a budget caps a node's CPU, it does not reserve a core, "
    "so other load on the machine takes from the nodes and moves the ratios."
)
OWN_GROUND = "own-ground"  # the bench whose kept results fill the README's second table
# Figure-name prefix of each cluster, and how the table names it.
OWN_GROUND_CLUSTERS = {
    "": "static `small-1124`",
    "shifting_load_": "`shifting-load`",
    "leave_return_": "`leave-return`",
}
# Figure-name suffix of each baseline, and how a column names it (in this order).
OWN_GROUND_BASES = {
    "weighted_ddp": "weighted DDP",
    "weighted_ddp_rebalance": "weighted DDP rebalanced",
    "ddp_kept": "DDP on kept nodes",
    "ddp": "DDP",
    "equal_sync": "equal-sync",
    "async": "async",
}
OWN_GROUND_REGIMES = ("small", "heavy")


def own_ground_table(results: Sequence[Result]) -> list[str]:
    """The README's table of ``python -m bench own-ground``: a row per cluster and regime, from
    the kept result with the most seeds of weighted-sync there (the newest on a tie). Each ratio
    cell is a baseline's epoch time and time to target over weighted-sync's; a column no row
    has a figure in is left out.

    Args:
        results: kept results of any benches; only own-ground's are read.

    Returns:
        The table's lines after a blank line, or nothing when no own-ground result is kept.
    """
    picked = []
    for prefix, cluster in OWN_GROUND_CLUSTERS.items():
        for regime in OWN_GROUND_REGIMES:
            label = f"{prefix}{regime}"
            runs = f"runs_{label}_weighted_sync"
            held = [r for r in results if r.bench == OWN_GROUND and runs in r.figures]
            if held:
                best = max(held, key=lambda r: (r.figures[runs], r.date))
                picked.append((cluster, regime, label, best))
    rows = []
    for cluster, regime, label, result in picked:
        figures = result.figures
        target = result.settings.get("target_oa")
        row = [cluster, f"{regime}, target {target}" if target else regime]
        row.append(f"{figures[f'runs_{label}_weighted_sync']:.0f}")
        for base in OWN_GROUND_BASES:
            ratios = [
                figures.get(f"ratio_{label}_{kind}_weighted_sync_vs_{base}")
                for kind in ("epoch", "ttt")
            ]
            row.append(" / ".join("–" if v is None else f"{v:.2f}×" for v in ratios))
        diff = figures.get(f"final_oa_diff_{label}_weighted_sync_vs_static")
        row.append("–" if diff is None else f"{diff:+.3f}")
        once = figures.get(f"exactly_once_{label}_weighted_sync")
        row.append("–" if once is None else "yes" if once else "**no**")
        row.append(f"{result.date[:10]}, load {_load(result.machine.get('load_average'))}")
        rows.append(row)
    if not rows:
        return []
    columns = ["own ground", "regime", "seeds"]
    columns += [f"vs {name}: epoch / to target" for name in OWN_GROUND_BASES.values()]
    columns += ["final OA vs static", "every sample once", "measured"]
    shown = [i for i in range(len(columns)) if any(row[i].strip("– /") for row in rows)]
    columns = [columns[i] for i in shown]
    rows = [[row[i] for i in shown] for row in rows]
    return ["", *markdown_table(columns, rows)]


def readme_table(results: dict[str, Result]) -> str:
    """The README's results table (between its markers) from the kept results by file stem,
    the own-ground table from the kept own-ground results, and a note on reading them.

    Args:
        results: kept results by file name without ``.json``.

    Returns:
        The marked block, markers included.
    """
    rows = []
    for stem, regime, cluster, regime_text in README_ROWS:
        if stem not in results:
            continue
        result = results[stem]
        figures = result.figures
        ws, ddp = f"{regime}_weighted_sync", f"{regime}_ddp"
        drop = _pair(figures, f"max_drop_{ws}_median", f"max_drop_{ddp}_median")
        if drop != "–" and f"max_drop_{ws}_max" in figures:
            drop += f" (max {_pair(figures, f'max_drop_{ws}_max', f'max_drop_{ddp}_max')})"
        runs = figures.get(f"runs_{ws}")
        rows.append(
            [
                cluster,
                f"{regime_text}; {runs:.0f} seeds" if runs else regime_text,
                f"{figures[f'ratio_{regime}_epoch_weighted_sync_vs_ddp']:.2f}×",
                f"{figures[f'ratio_{regime}_ttt_weighted_sync_vs_ddp']:.2f}×",
                _pair(figures, f"final_oa_{ws}_median", f"final_oa_{ddp}_median"),
                drop,
                f"{result.date[:10]}, load {_load(result.machine.get('load_average'))}",
            ]
        )
    own = own_ground_table(list(results.values()))
    block = [README_START, *markdown_table(README_COLUMNS, rows), *own, "", README_NOTE, README_END]
    return "\n".join(block)


def with_readme_table(readme: str, table: str) -> str:
    """``readme`` with the text between its table markers replaced by ``table``.

    Raises:
        ValueError: the README has no pair of markers.
    """
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no results-table markers ({README_START!r})")
    return readme[:start] + table + readme[end + len(README_END) :]
