"""The server's status in the Prometheus text exposition format (``/metrics``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, type, help, key in the status map
RUN_METRICS = (
    ("pserver_version", "gauge", "Parameter version (updates applied so far).", "version"),
    ("pserver_epoch", "gauge", "Epoch the sampler is handing out.", "epoch"),
    ("pserver_steps_total", "counter", "Updates applied.", "steps"),
    ("pserver_samples_seen_total", "counter", "Training samples applied.", "samples_seen"),
    ("pserver_training", "gauge", "1 while training runs.", "training"),
    ("pserver_finished", "gauge", "1 once training has ended.", "finished"),
    ("pserver_waiting_for_workers", "gauge", "Workers awaited before round 1.", "waiting_for"),
)
EVAL_METRICS = (
    ("pserver_eval_oa", "Overall accuracy of the last evaluation (test split).", "oa"),
    ("pserver_eval_aa", "Average per-class accuracy of the last evaluation.", "aa"),
    ("pserver_eval_kappa", "Cohen's kappa of the last evaluation.", "kappa"),
    ("pserver_eval_loss", "Mean cross-entropy of the last evaluation.", "loss"),
)
# name, type, help, where: "status" (the worker's status entry) or "view" (the live history)
WORKER_METRICS = (
    ("pserver_worker_speed", "gauge", "Measured speed, samples per second of compute.", "speed"),
    ("pserver_worker_slowdown", "gauge", "Emulated slowdown factor.", "slowdown"),
    ("pserver_worker_active", "gauge", "1 while the worker is a member.", "active"),
    ("pserver_worker_samples_total", "counter", "Training samples applied.", "samples"),
    ("pserver_worker_pushes_total", "counter", "Pushes applied.", "pushes"),
    ("pserver_worker_rejected_total", "counter", "Pushes rejected as stale.", "rejected"),
    ("pserver_worker_batch_share", "gauge", "Share of the last round's batch.", "batch_share"),
    ("pserver_worker_idle_seconds_total", "counter", "Seconds idle at sync barriers.", "idle_s"),
    ("pserver_worker_staleness", "gauge", "Staleness of the last applied push.", "staleness_last"),
)


def _value(value: Any) -> str | None:
    """A sample value in exposition syntax, or None when there is nothing numeric."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if not isinstance(value, int | float):
        return None
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if isinstance(value, float) else str(value)


def _label(value: str) -> str:
    """A label value escaped as the format requires (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(status: Mapping[str, Any], view: Mapping[str, Any] | None = None) -> str:
    """Render the status map (and the live view's per-worker totals) as exposition text.

    Args:
        status: what ``pserver status`` returns (``pserver.summary.status_of``).
        view: ``LiveView.snapshot()`` (batch share, idle time, staleness), or None.

    Returns:
        The text, one ``# HELP`` and ``# TYPE`` line per metric family, ending in a newline.
    """
    lines: list[str] = []

    def family(name: str, kind: str, text: str, samples: list[tuple[str, str]]) -> None:
        if not samples:
            return
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    mode = _label(str(status.get("mode", "")))
    family(
        "pserver_info",
        "gauge",
        "Run settings as labels (value 1).",
        [(f'{{mode="{mode}",model="{_label(str(status.get("model", "")))}"}}', "1")],
    )
    for name, kind, text, key in RUN_METRICS:
        value = _value(status.get(key))
        family(name, kind, text, [("", value)] if value is not None else [])
    last = status.get("last_eval") or {}
    for name, text, key in EVAL_METRICS:
        value = _value(last.get(key))
        family(name, "gauge", text, [("", value)] if value is not None else [])
    totals = (view or {}).get("workers", {})
    workers = [w for w in status.get("workers", []) if isinstance(w, Mapping)]
    for name, kind, text, key in WORKER_METRICS:
        samples = []
        for worker in workers:
            worker_name = str(worker.get("name", ""))
            source = worker if key in worker else totals.get(worker_name, {})
            value = _value(source.get(key))
            if value is not None:
                device = _label(str(worker.get("device", "")))
                labels = f'{{worker="{_label(worker_name)}",device="{device}"}}'
                samples.append((labels, value))
        family(name, kind, text, samples)
    return "\n".join(lines) + "\n"
