"""The history check on hand-made histories: clean ones (with a resume that replays versions)
pass; each rule finds the fault planted against it, and only that rule."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pserver.history import RULES, check_history, read_history

TRAIN, BATCH = 10, 4  # rounds of 4, 4 and a tail of 2


def _start(mode: str = "weighted-sync", **more: Any) -> dict[str, Any]:
    return {
        "event": "start",
        "t": 0.0,
        "mode": mode,
        "train": TRAIN,
        "global_batch": BATCH,
        "staleness": None,
        **more,
    }


def _round(version: int, epoch: int, batches: dict[str, int], t: float) -> dict[str, Any]:
    workers = [{"worker": w, "batch": b, "accepted_t": t - 0.05} for w, b in batches.items()]
    weight = round(sum(batches.values()) / BATCH, 6)
    return {
        "event": "round",
        "t": t,
        "round": version,
        "epoch": epoch,
        "version": version,
        "weight": weight,
        "workers": workers,
    }


def _epoch(epoch: int, version: int) -> dict[str, Any]:
    return {
        "event": "epoch",
        "t": 0.0,
        "epoch": epoch,
        "samples": TRAIN,
        "exactly_once": True,
        "version": version,
    }


def _sync_epoch(epoch: int, first: int, t: float) -> list[dict[str, Any]]:
    return [
        _round(first, epoch, {"a": 3, "b": 1}, t),
        _round(first + 1, epoch, {"a": 2, "b": 2}, t + 1),
        _round(first + 2, epoch, {"a": 2}, t + 2),  # the tail: weight 2 / 4
        _epoch(epoch, first + 2),
    ]


def _sync() -> list[dict[str, Any]]:
    """Two epochs; the server dies in epoch 2 after version 5 and resumes from version 4, so
    version 5 is made again; worker b leaves and joins again meanwhile."""
    joins = [{"event": "join", "t": 0.1, "worker": w} for w in ("a", "b")]
    return [
        _start(),
        *joins,
        *_sync_epoch(1, 1, 1.0),
        _round(4, 2, {"a": 3, "b": 1}, 5.0),
        _round(5, 2, {"a": 4}, 6.0),
        {"event": "resume", "t": 5.5, "version": 4, "samples": 14, "requeued": 4},
        _start(),
        *[{**j, "t": 5.6} for j in joins],
        {"event": "leave", "t": 6.0, "worker": "b", "reason": "dead: silent for 3 s"},
        _round(5, 2, {"a": 4}, 6.5),
        {"event": "join", "t": 6.7, "worker": "b"},
        _round(6, 2, {"b": 2}, 7.0),
        _epoch(2, 6),
        {"event": "finish", "t": 7.1, "reason": "epochs", "version": 6},
    ]


def _push(version: int, epoch: int, batch: int, staleness: int, t: float) -> dict[str, Any]:
    scale = batch / BATCH / (staleness + 1)  # the inverse rule
    return {
        "event": "push",
        "t": t,
        "worker": "a",
        "batch": batch,
        "speed": 10.0,
        "accepted_t": t - 0.01,
        "epoch": epoch,
        "staleness": staleness,
        "lr_scale": scale,
        "version": version,
    }


def _async() -> list[dict[str, Any]]:
    rule = {"function": "inverse", "a": 0.5, "b": 4.0, "max": 4}
    pushes = [_push(v, 1, b, s, v) for v, (b, s) in enumerate([(3, 0), (3, 1), (4, 4)], 1)]
    return [_start("async", staleness=rule), *pushes, _epoch(1, 3)]


def _lines(history: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return list(enumerate(copy.deepcopy(history), 1))


def _rules(history: list[dict[str, Any]]) -> set[str]:
    return {v.rule for v in check_history(_lines(history))}


@pytest.mark.parametrize("history", [_sync(), _async()], ids=["sync-with-resume", "async"])
def test_a_clean_history_keeps_every_rule(history: list[dict[str, Any]]) -> None:
    assert check_history(_lines(history)) == []


def _planted(rule: str) -> list[dict[str, Any]]:
    """A history that breaks ``rule`` once (and no other rule)."""
    if rule in ("staleness", "lr_scale"):
        history = _async()
        push = history[3]
        if rule == "staleness":
            push.update(staleness=5, lr_scale=push["batch"] / BATCH / 6)
        else:
            push["lr_scale"] *= 2
        return history
    history = _sync()
    rounds = [e for e in history if e["event"] == "round"]
    if rule == "versions":
        rounds[1]["version"] = 3  # 1, 3, 3: a gap, then a version made twice
    elif rule == "weights":
        rounds[0]["weight"] = 0.5  # 4 samples at half a step
    elif rule == "epochs":
        rounds[2]["workers"][0]["batch"] = 3  # epoch 1's tail covers 3 samples: 11 in all
        rounds[2]["weight"] = 0.75
    elif rule == "departed":
        rounds[-1]["workers"][0]["accepted_t"] = 6.5  # b's push taken after it left
    return history


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_finds_the_fault_planted_against_it(rule: str) -> None:
    assert _rules(_planted(rule)) == {rule}


def test_a_resume_past_the_recorded_updates_is_a_version_violation() -> None:
    history = _sync()
    resume = next(e for e in history if e["event"] == "resume")
    resume["version"] = 5  # resumed after version 5, whose round is in no line of the file
    history = [e for e in history if e["event"] != "round" or e["version"] != 5]
    found = check_history(_lines(history))
    assert found[0].rule == "versions"
    assert "past the last recorded update 4" in found[0].detail


def test_a_torn_line_is_left_out_and_the_next_event_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    events = [json.dumps(e) for e in _sync()]
    path.write_text(events[0] + "\n" + events[1][:20] + "\n" + "\n".join(events[1:]) + "\n")
    records = read_history(path)
    assert len(records) == len(events) and records[1][0] == 3
    assert check_history(records) == []
