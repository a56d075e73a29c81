"""The multi-host bench's table: round and communication times, ratios against gloo + compute."""

from __future__ import annotations

import statistics
from typing import Any

from bench.harness.stats import spread_text
from bench.multihost.config import BenchConfig
from bench.report import markdown_table

SMALL = "-small"  # the suffix of a variant's small-compute run (``--small-batch``)


def _pooled(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [v for run in runs for v in run[key]]


def reference(gloo_runs: list[dict[str, Any]], compute_s: float = 0.0) -> dict[str, float]:
    """The baseline figures pooled over repeats.

    Args:
        gloo_runs: the results of ``run_gloo``.
        compute_s: a given compute time per step (e.g. a GPU's); 0 uses the measured one.

    Returns:
        ``allreduce_s`` (median), ``compute_s`` (``compute_s`` if given, else the fastest of
        every rank's solo steps: other jobs on the machine only ever add to a step's time),
        ``compute_median_s``, ``ddp_step_s`` (median) and ``reference_s`` = all-reduce +
        compute.
    """
    allreduce = statistics.median(_pooled(gloo_runs, "allreduce_s"))
    solo = _pooled(gloo_runs, "compute_s")
    compute = compute_s or min(solo)
    step = statistics.median(_pooled(gloo_runs, "ddp_step_s"))
    return {
        "allreduce_s": allreduce,
        "compute_s": compute,
        "compute_median_s": statistics.median(solo),
        "ddp_step_s": step,
        "reference_s": allreduce + compute,
    }


COLUMNS = (
    "variant",
    "samples from",
    "round min / median / max (s)",
    "communication median (s)",
    "worker compute median (s, shared cores)",
    "est. round, own cores (s)",
    "× (all-reduce + compute)",
    "communication × all-reduce",
    "× DDP step (both on shared cores)",
)


def table(
    cfg: BenchConfig,
    gloo_runs: list[dict[str, Any]],
    ps_runs: dict[str, list[dict[str, Any]]],
    failures: dict[str, list[str]],
) -> tuple[str, dict[str, Any]]:
    """Format the results as a Markdown table and collect the figures it shows.

    Args:
        cfg: the bench settings.
        gloo_runs: ``run_gloo`` results, one per repeat.
        ps_runs: per variant, ``run_ps`` results, one per successful repeat.
        failures: per variant, the errors of failed repeats.

    Returns:
        The text to print and a JSON-ready dict of the figures.
    """
    ref = reference(gloo_runs, cfg.compute_s) if gloo_runs else None
    rows: list[list[str]] = []
    figures: dict[str, Any] = {"reference": ref, "variants": {}}
    if ref is not None:
        how = "given" if cfg.compute_s else "fastest alone"
        allreduce, steps = _pooled(gloo_runs, "allreduce_s"), _pooled(gloo_runs, "ddp_step_s")
        rows += [
            ["gloo all-reduce of the flat gradient", "-", spread_text(allreduce),
             f"{ref['allreduce_s']:.3f}", "-", "-", "-", "1.00", "-"],
            [f"one step's compute ({how})", "local copy", "-", "-",
             f"{ref['compute_s']:.3f}", "-", "-", "-", "-"],
            ["**all-reduce + compute (reference)**", "local copy", "-", "-", "-",
             f"{ref['reference_s']:.3f}", "1.00", "-", "-"],
            ["DDP step (gloo, bucketed, ranks compute at once)", "local copy",
             spread_text(steps), "-", "-", "-", "-", "-", "1.00"],
        ]  # fmt: skip
    suffixes = ("", SMALL) if cfg.small_batch else ("",)
    for name in [v + suffix for v in cfg.variants for suffix in suffixes]:
        variant = cfg.variant(name.removesuffix(SMALL))
        source = "local copy" if variant.local_data else "server, over the links"
        runs = ps_runs.get(name, [])
        if not runs:
            why = "; ".join(failures.get(name, ["no run"]))[:200]
            rows.append([name, source, f"failed: {why}", *[""] * 6])
            continue
        rounds, comm = _pooled(runs, "round_s"), _pooled(runs, "comm_s")
        compute = _pooled(runs, "compute_s")
        row: dict[str, Any] = {
            "round_s": {
                "median": statistics.median(rounds),
                "min": min(rounds),
                "max": max(rounds),
            },
            "comm_s_median": statistics.median(comm),
            "compute_s_median": statistics.median(compute),
            "compute_source": runs[0]["compute_source"],
            "batches": runs[-1]["batches"],
            "repeats": len(runs),
        }
        cells = ["-", "-", "-", "-"]
        if ref is not None:  # a small-compute run is set against its own compute
            step = row["compute_s_median"] if name.endswith(SMALL) else ref["compute_s"]
            row["estimated_round_s"] = row["comm_s_median"] + step
            row["ratio_reference"] = row["estimated_round_s"] / (ref["allreduce_s"] + step)
            row["ratio_comm_allreduce"] = row["comm_s_median"] / ref["allreduce_s"]
            row["ratio_ddp_step"] = row["round_s"]["median"] / ref["ddp_step_s"]
            cells = [
                f"{row['estimated_round_s']:.3f}",
                f"**{row['ratio_reference']:.2f}**",
                f"{row['ratio_comm_allreduce']:.2f}",
                f"{row['ratio_ddp_step']:.2f}",
            ]
        figures["variants"][name] = row
        rows.append(
            [name, source, spread_text(rounds), f"{row['comm_s_median']:.3f}",
             f"{row['compute_s_median']:.3f}", *cells]
        )  # fmt: skip
    return "\n".join(markdown_table(COLUMNS, rows)), figures


def legend(cfg: BenchConfig, figures: dict[str, Any], params: int | None) -> str:
    """The lines printed under the table: what each column means and the batch plans."""
    text = [
        f"model {cfg.model}"
        + (f" ({params:,} parameters, {params * 4 / 1e6:.1f} MB in fp32)" if params else "")
        + f"; {cfg.workers} workers x {cfg.batch} samples (global batch {cfg.batch * cfg.workers});"
        f" links (server first): {','.join(cfg.rates)}; {cfg.repeats} interleaved repeats,"
        f" {cfg.steps} steps per run, first {cfg.warmup} rounds left out",
        "communication = round time minus the slowest worker's compute in that round (it also "
        "holds the server's aggregation and optimizer step); est. round, own cores = "
        "communication + one step's compute, i.e. the round each host would see with its own "
        "CPU. Raw round times are on the shared cores: the workers' compute competes.",
        f"{SMALL} rows: the same variant with {cfg.small_batch} sample(s) per worker, a step "
        "too short for the push to hide behind backward; their est. round and × (all-reduce + "
        "compute) use their own workers' compute, and communication × all-reduce shows the "
        "wire alone",
    ]
    ref = figures["reference"]
    if ref is not None:
        source = (
            "given by --compute-s"
            if cfg.compute_s
            else "the fastest solo step (other jobs on the machine only add time)"
        )
        text.append(
            f"one step's compute {ref['compute_s']:.3f} s: {source}; the median solo step "
            f"was {ref['compute_median_s']:.3f} s"
        )
    for name, row in figures["variants"].items():
        text.append(
            f"{name}: median batch per worker {row['batches']} "
            f"(worker compute from {row['compute_source']})"
        )
    return "\n".join(text)
