"""Where a sharded weighted-sync round goes: its critical path from stage marks.

Reads the stage marks (``common.stagetrace``) that workers and shards of one run wrote to
``RUN_DIR/trace`` and cuts each round (parameters version v -> v + 1) at points along its
critical path, each the latest (or, for the start, the earliest) mark of its kind in the round:

    start       first worker starts its step's compute on version v
    compute     last worker whose push goes into the round ends forward + backward (chunks
                sent during backward included); the points up to "wire out" likewise count
                the pushes the round applies (one held over from the round before included)
    push tail   last gradient chunk handed to ZeroMQ after backward
    wire in     last gradient chunk read by a shard
    stage       last chunk staged (copied and checked) on its shard
    coord ask   last "staged?" request from the coordinator reaches a shard
    staged      last shard answers it
    prepare ask last "prepare" request reaches a shard (coordinator round trip)
    optimizer   last shard has computed the candidate (the optimizer step)
    publish ask last "publish" request reaches a shard (coordinator round trip)
    publish     last shard has published and queued its parameter chunks
    task reply  last worker has the coordinator's answer to its push
    wire out    last worker has every parameter chunk loaded (these two leave out workers
                that sit out the next round: their answer waits for that round to end)
    next        first worker starts computing on v + 1 (data, loading the model)

A stage's time is how far its point lies past every earlier point (0 when it is already
behind), so the stages add up to the round. All processes run on one machine and mark
``time.monotonic()``, one clock for every namespace.

Usage: python -m bench.multihost.stages RUN_DIR [RUN_DIR ...] [--warmup 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

from bench.harness.record import parse_settings

STAGES = (
    "compute",
    "push tail",
    "wire in",
    "stage",
    "coord ask",
    "staged",
    "prepare ask",
    "optimizer",
    "publish ask",
    "publish",
    "task reply",
    "wire out",
    "next",
)


# Points that a worker planned to sit out the next round reaches only when that round ends
# (its push is answered with its next task): they are not on this round's path.
SITTING_OUT = ("task reply", "wire out")


def read_marks(trace: Path) -> dict[str, list[dict[str, Any]]]:
    """Every mark of a run's trace directory, by role (``worker``, ``shard``)."""
    marks: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for path in sorted(trace.glob("*.jsonl")):
        role = path.name.split("-", 1)[0]
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                mark = json.loads(line)
            except ValueError:
                continue  # a line cut short when the process was killed
            marks[role].append(mark)
    return marks


def rounds(marks: dict[str, list[dict[str, Any]]]) -> dict[int, dict[str, float]]:
    """Per version v, the round's stage times in seconds (see the module docstring)."""
    worker, shard = marks.get("worker", []), marks.get("shard", [])
    version_of = {m["task"]: m["version"] for m in worker if m["ev"] == "w_task"}
    # The round that applied a task: the one whose parameters answered its push (a push the
    # coordinator holds over to the next round belongs there), else the version it computed on.
    round_of = dict(version_of)
    round_of.update({m["task"]: m["version"] - 1 for m in worker if m["ev"] == "w_params"})
    points: dict[int, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )

    def put(version: int | None, point: str, t: float) -> None:
        if version is not None:
            points[version][point].append(t)

    for m in worker:
        ev, t = m["ev"], m["t"]
        v = round_of.get(m.get("task", -1))
        if ev == "w_compute":
            computed_on = version_of.get(m["task"])
            put(computed_on, "start", t)
            put(None if computed_on is None else computed_on - 1, "next", t)
        elif ev == "w_computed":
            put(v, "compute", t)
        elif ev in ("w_chunk_out", "w_push"):
            put(v, "push tail", t)
        elif ev == "w_reply":
            put(v, "task reply", t)
        elif ev == "w_params":
            put(v, "wire out", t)
    by_type = {
        "s_chunk_in": "wire in",
        "s_chunk_staged": "stage",
        "s_staged_request": "coord ask",
        "s_staged_request_done": "staged",
    }
    per_version = {
        "s_prepare_request": "prepare ask",
        "s_prepare_request_done": "optimizer",
        "s_publish_request": "publish ask",
    }
    untagged = []  # "staged" answers marked without their task: placed by time below
    for m in shard:
        ev, t = m["ev"], m["t"]
        if ev == "s_staged_request_done" and m.get("task") is None:
            untagged.append(t)
        elif ev in by_type:
            put(round_of.get(m.get("task", -1)), by_type[ev], t)
        elif ev in per_version:
            put(m["version"], per_version[ev], t)
        elif ev == "s_publish_request_done":
            put(m["version"] - 1, "publish", t)  # published: the shard is at v + 1
    for got in points.values():
        asked, applied = got.get("coord ask"), got.get("prepare ask")
        if asked and applied:
            got["staged"] += [t for t in untagged if min(asked) <= t <= max(applied)]
    out = {}
    for v, got in points.items():
        if not got.get("start") or not got.get("next") or any(not got.get(s) for s in STAGES):
            continue
        begin, following = min(got["start"]), min(got["next"])
        reached = begin
        stages = {}
        for stage in STAGES:
            times = got[stage]
            if stage in SITTING_OUT:  # a worker left out of the next round gets its answer later
                times = [t for t in times if t <= following] or [begin]
            at = following if stage == "next" else max(times)
            stages[stage] = max(0.0, at - reached)
            reached = max(reached, at)
        stages["round"] = reached - begin
        out[v] = stages
    return out


def summarise(run_dir: Path, warmup: int) -> dict[str, float]:
    """Median seconds per stage over the run's rounds past ``warmup``."""
    per_round = rounds(read_marks(run_dir / "trace"))
    kept = [per_round[v] for v in sorted(per_round)][warmup:]
    if not kept:
        raise SystemExit(f"{run_dir}: no complete round past {warmup} warm-up rounds")
    medians = {k: statistics.median(r[k] for r in kept) for k in (*STAGES, "round")}
    medians["rounds"] = len(kept)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories holding trace/")
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out at the start")
    args = parse_settings(parser, argv)
    columns = [(run.name, summarise(run, args.warmup)) for run in args.runs]
    print(f"{'stage (median ms)':<20}" + "".join(f"{name:>18}" for name, _ in columns))
    for stage in (*STAGES, "round"):
        row = "".join(f"{c[stage] * 1000:>18.1f}" for _, c in columns)
        print(f"{stage:<20}{row}")
    print(f"{'rounds':<20}" + "".join(f"{c['rounds']:>18d}" for _, c in columns))


if __name__ == "__main__":
    main()
