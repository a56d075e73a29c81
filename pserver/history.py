"""The rules a run's recorded history (its ``metrics.jsonl``) keeps, restarts accounted for,
and the check of a history against them.

A resumed server continues from its checkpoint's version: the updates the dead server had
applied past it are made again, so the history that counts (the effective history) drops,
at each ``resume`` event, every update and epoch recorded past the version resumed. The rules
(``RULES``) are judged on what each event records; the run's own settings (global batch,
training split, staleness rule) come from its ``start`` events.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pserver.policies.staleness import lr_scale, staleness_function

RULES = {
    "versions": "after a start at 0 or a resume at v, the updates make versions v+1, v+2, ... "
    "(one update per version), and a resume never lies past the recorded updates",
    "weights": "sync: a round's gradient weights sum to its samples over B (1 for a full "
    "global batch, b / B for an epoch's tail)",
    "epochs": "each epoch's updates cover the training split exactly once (and the server's "
    "own check agrees); each epoch completes once, none is skipped",
    "staleness": "async: every applied push is within --max-staleness",
    "lr_scale": "async: a push's learning-rate scale is (b / B) f(staleness), f its rule",
    "departed": "no push is accepted from a worker between its leave and its next join",
}
WEIGHT_TOLERANCE = 1e-6  # round events keep 6 decimals
UPDATES = ("round", "push")


@dataclasses.dataclass(frozen=True)
class Violation:
    """A rule the history breaks: ``rule`` (a key of ``RULES``), the 1-based ``line`` of
    ``metrics.jsonl`` where it shows (0: the history as a whole) and what was found."""

    rule: str
    line: int
    detail: str

    def __str__(self) -> str:
        return f"{self.rule} (line {self.line}): {self.detail}"


def read_history(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The events of ``metrics.jsonl`` with their line numbers; a torn line (cut short by a
    killed server) is left out.

    Raises:
        OSError: the file cannot be read.
    """
    records = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict) and isinstance(record.get("event"), str):
                records.append((number, record))
    return records


def check_history(records: Iterable[tuple[int, dict[str, Any]]]) -> list[Violation]:
    """Every violation of ``RULES`` in a history.

    Args:
        records: (line number, event) pairs in file order (``read_history``).

    Returns:
        The violations found, in order (empty: the history keeps every rule).
    """
    found: list[Violation] = []
    settings: dict[str, Any] = {}
    updates: list[dict[str, Any]] = []  # the effective history's updates and epochs
    epochs: list[tuple[int, dict[str, Any]]] = []
    version, resumed = 0, False
    gaps: dict[str, list[list[float]]] = {}  # name -> [leave t, next join t], this server's
    for line, event in records:
        kind = event["event"]
        if kind == "resume":
            if event["version"] > version:
                detail = f"resumed at {event['version']}, past the last recorded update {version}"
                found.append(Violation("versions", line, detail))
            version, resumed = event["version"], True
            updates = [u for u in updates if u["version"] <= version]
            epochs = [(n, e) for n, e in epochs if e["version"] <= version]
        elif kind == "start":
            settings, gaps = event, {}
            if not resumed:
                version, updates, epochs = 0, [], []
            resumed = False
        elif kind == "leave":
            gaps.setdefault(event["worker"], []).append([event["t"], math.inf])
        elif kind == "join" and gaps.get(event["worker"]):
            gaps[event["worker"]][-1][1] = min(gaps[event["worker"]][-1][1], event["t"])
        elif kind == "epoch":
            epochs.append((line, event))
        elif kind in UPDATES:
            if event["version"] != version + 1:
                detail = f"version {event['version']} after {version}"
                found.append(Violation("versions", line, detail))
            version = event["version"]
            found += _judge_update(line, event, settings, gaps)
            updates.append(event)
    return found + list(_judge_epochs(updates, epochs, settings.get("train")))


def _entries(update: dict[str, Any]) -> list[dict[str, Any]]:
    """The pushes an update event combines (a round's workers, or the push itself)."""
    return list(update.get("workers") or []) if update["event"] == "round" else [update]


def _judge_update(
    line: int, event: dict[str, Any], settings: dict[str, Any], gaps: dict[str, list[list[float]]]
) -> Iterator[Violation]:
    """The rules one update breaks: departed, weights, staleness, lr_scale."""
    entries = _entries(event)
    for entry in entries:
        t = entry.get("accepted_t")
        for left, back in gaps.get(entry["worker"], []):
            if t is not None and left < t < back:
                detail = f"{entry['worker']}'s push accepted at t={t}, after it left at t={left}"
                yield Violation("departed", line, detail)
    batch, samples = settings.get("global_batch"), sum(e["batch"] for e in entries)
    if batch is None:
        return
    if event["event"] == "round":
        if abs(event["weight"] - min(samples / batch, 1.0)) > WEIGHT_TOLERANCE:
            detail = f"weight {event['weight']} over {samples} samples, B = {batch}"
            yield Violation("weights", line, detail)
        return
    rule, tau = settings.get("staleness") or {}, event["staleness"]
    if rule.get("max") is not None and tau > rule["max"]:
        yield Violation("staleness", line, f"staleness {tau} > {rule['max']}")
    if rule:
        f = staleness_function(rule["function"], rule["a"], rule["b"])
        want = lr_scale(f, tau, samples, batch)
        if not math.isclose(event.get("lr_scale", math.nan), want, rel_tol=1e-9):
            detail = f"lr_scale {event.get('lr_scale')} at staleness {tau}, batch {samples}: {want}"
            yield Violation("lr_scale", line, detail)


def _judge_epochs(
    updates: list[dict[str, Any]], epochs: list[tuple[int, dict[str, Any]]], train: int | None
) -> Iterator[Violation]:
    """The epoch rule over the effective history."""
    samples: collections.Counter[int] = collections.Counter()
    for update in updates:
        samples[update["epoch"]] += sum(e["batch"] for e in _entries(update))
    done = [e["epoch"] for _, e in epochs]  # in any order: async tails may come late
    if sorted(done) != list(range(1, len(done) + 1)):
        yield Violation("epochs", 0, f"epochs completed: {sorted(done)}")
    for line, event in epochs:
        counted, applied = event["samples"], samples[event["epoch"]]
        if not (event["exactly_once"] and train is not None and counted == applied == train):
            detail = (
                f"epoch {event['epoch']}: the server counted {counted} (exactly once: "
                f"{event['exactly_once']}), its updates {applied}, the split {train}"
            )
            yield Violation("epochs", line, detail)
    for epoch, applied in sorted(samples.items()):
        if train is not None and epoch not in done and applied > train:
            yield Violation("epochs", 0, f"epoch {epoch}: {applied} samples of {train} applied")
