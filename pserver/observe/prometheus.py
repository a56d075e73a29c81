"""The server's status in the Prometheus text exposition format (``/metrics``), rendered by
``prometheus_client`` from the status map on each request."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what ``generate_latest`` writes

# name, type, help, key in the status map (RUN) or in its last evaluation (EVAL)
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
    ("pserver_eval_oa", "gauge", "Overall accuracy of the last evaluation (test split).", "oa"),
    ("pserver_eval_aa", "gauge", "Average per-class accuracy of the last evaluation.", "aa"),
    ("pserver_eval_kappa", "gauge", "Cohen's kappa of the last evaluation.", "kappa"),
    ("pserver_eval_loss", "gauge", "Mean cross-entropy of the last evaluation.", "loss"),
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


def _number(value: Any) -> float | None:
    """A sample value (booleans as 0/1), or None when there is nothing numeric."""
    if isinstance(value, bool | int | float):
        return float(value)
    return None


def _family(
    kind: str, name: str, text: str, labels: Sequence[str] = ()
) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty metric family; a counter's name is given without its ``_total`` suffix."""
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), text, labels=labels)
    return GaugeMetricFamily(name, text, labels=labels)


class _StatusCollector(Collector):
    """The families of one status map and live view; a family without samples is left out."""

    def __init__(self, status: Mapping[str, Any], view: Mapping[str, Any] | None) -> None:
        self.status, self.view = status, view

    def collect(self) -> Iterator[Metric]:
        status = self.status
        info = GaugeMetricFamily(
            "pserver_info", "Run settings as labels (value 1).", labels=("mode", "model")
        )
        info.add_metric((str(status.get("mode", "")), str(status.get("model", ""))), 1)
        yield info
        last = status.get("last_eval") or {}
        for table, source in ((RUN_METRICS, status), (EVAL_METRICS, last)):
            for name, kind, text, key in table:
                value = _number(source.get(key))
                if value is not None:
                    family = _family(kind, name, text)
                    family.add_metric((), value)
                    yield family
        totals = (self.view or {}).get("workers", {})
        workers = [w for w in status.get("workers", []) if isinstance(w, Mapping)]
        for name, kind, text, key in WORKER_METRICS:
            family = _family(kind, name, text, ("worker", "device"))
            for worker in workers:
                worker_name = str(worker.get("name", ""))
                source = worker if key in worker else totals.get(worker_name, {})
                value = _number(source.get(key))
                if value is not None:
                    family.add_metric((worker_name, str(worker.get("device", ""))), value)
            if family.samples:
                yield family


def render(status: Mapping[str, Any], view: Mapping[str, Any] | None = None) -> str:
    """Render the status map (and the live view's per-worker totals) as exposition text.

    Args:
        status: what ``pserver status`` returns (``pserver.summary.StatusView.status``).
        view: ``LiveView.snapshot()`` (batch share, idle time, staleness), or None.

    Returns:
        The text, one ``# HELP`` and ``# TYPE`` line per metric family, ending in a newline.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(status, view))
    return generate_latest(registry).decode("utf-8")
