"""Random faults during real runs; afterwards each run's own history is checked against the
rules of ``pserver.history``, its final OA against the same run without faults.

The runs, the faults and their rates are described in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench import ROOT
from bench.harness.cluster import add_cluster_arguments, cluster_from_args, worker_count
from bench.harness.record import parse_settings
from common.data.convert.synth import synth_hsi
from common.errors import PSError
from common.logsetup import setup_logging
from common.training.tables import format_table
from launch.cluster.budgets import PREFIX, find_cpu_hierarchy
from launch.local import LocalCluster, run_local
from launch.procs import EventTail
from pserver.history import check_history, read_history

RUNS = {  # name: mode, shards, server options
    "weighted-sync": ("weighted-sync", 1, ()),
    "async": ("async", 1, ("--max-staleness", "4")),
    "sharded": ("equal-sync", 2, ()),
}
SERVER = ("--global-batch", "32", "--lr", "0.05", "--dead-after", "3", "--heartbeat", "0.5")
ROLES = {
    "pserver.cli start": "coordinator",
    "pserver.cli shard": "shard",
    "worker.cli join": "worker",
}
WEIGHTS = {"coordinator": 0.25, "shard": 0.15, "worker": 0.45, "stop": 0.15}  # per fault
PACE_EPOCHS = 2  # of the run that measures the pace (without --epochs)
COLUMNS = ["run", "epochs", "faults", "kinds", "restarts server / workers", "versions replayed",
           "violations", "finished", "OA faulted", "OA without"]  # fmt: skip


class Chaos(threading.Thread):
    """Injects faults into this process's children from the run's ``train_start`` event until
    its ``finish`` event (or ``finish`` is set); stopped workers are continued when they are
    due, and at the end.

    Args:
        metrics: the run's ``metrics.jsonl``.
        mtbf_s, stop_s: mean time between faults, and how long a stopped worker stays stopped.
        rng: draws the delays and the victims.
        shards: whether the run has shards to kill.
    """

    def __init__(
        self, metrics: Path, mtbf_s: float, *, stop_s: float, rng: random.Random, shards: bool
    ) -> None:
        super().__init__(name="chaos", daemon=True)
        self.metrics, self.mtbf_s, self.stop_s, self.rng = metrics, mtbf_s, stop_s, rng
        self.kinds = [k for k in WEIGHTS if shards or k != "shard"]
        self.finish = threading.Event()
        self.faults: list[dict[str, Any]] = []
        self.groups: set[int] = set()  # every process group seen: all must be gone at the end
        self._stopped: dict[int, float] = {}  # pid -> when to continue it
        self._events, self.training = EventTail(metrics, 0), False

    def run(self) -> None:
        begin, due = time.monotonic(), None
        while not self.finish.wait(0.5) and not self._finished():
            now = time.monotonic()
            for pid in [p for p, at in self._stopped.items() if at <= now]:
                del self._stopped[pid]
                self._signal(pid, signal.SIGCONT)
            due = due or (now + self._delay() if self.training else None)
            if due is not None and now >= due:
                self._fault(round(now - begin, 1))
                due = now + self._delay()
        for pid in list(self._stopped):
            self._signal(pid, signal.SIGCONT)

    def _delay(self) -> float:
        return min(max(self.rng.expovariate(1 / self.mtbf_s), self.mtbf_s / 5), 3 * self.mtbf_s)

    def _finished(self) -> bool:
        """Whether the run wrote its ``finish`` event since the last look; notes when training
        started."""
        kinds = {event.get("event") for event in self._events.read()}
        self.training |= "train_start" in kinds
        return "finish" in kinds

    def _fault(self, t: float) -> None:
        """One fault, its kind drawn by ``WEIGHTS``, on a process of that kind (none when no
        such process runs just now)."""
        kind = self.rng.choices(self.kinds, [WEIGHTS[k] for k in self.kinds])[0]
        victims = []
        for proc in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                args = proc.cmdline()
                role = next((r for key, r in ROLES.items() if key in " ".join(args)), None)
                self.groups |= {proc.pid} if role else set()  # each leads a group of its own
                if role == ("worker" if kind == "stop" else kind) and proc.pid not in self._stopped:
                    named = args[args.index("--name") + 1] if "--name" in args else role
                    victims.append((proc.pid, named))
        if victims:
            pid, name = self.rng.choice(victims)
            self._signal(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
            if kind == "stop":
                self._stopped[pid] = time.monotonic() + self.stop_s
            self.faults.append({"t": t, "kind": kind, "target": name, "pid": pid})

    @staticmethod
    def _signal(group: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)


def one_run(
    base: LocalCluster, run_dir: Path, name: str, epochs: int, chaos: Chaos | None = None
) -> dict[str, Any]:
    """Run ``name`` of ``epochs`` epochs on ``base``'s cluster, ``chaos`` injecting faults if
    given: its summary, or its error."""
    mode, shards, options = RUNS[name]
    options = (*SERVER, "--epochs", str(epochs), *options)
    run = dataclasses.replace(
        base, mode=mode, shards=shards, run_dir=run_dir, server_options=options
    )
    if chaos is not None:
        chaos.start()
    try:
        with run_dir.with_suffix(".log").open("w", encoding="utf-8") as log:
            return run_local(run, log)
    except PSError as exc:
        return {"error": str(exc)}
    finally:
        if chaos is not None:
            chaos.finish.set()
            chaos.join()


def chaos_run(
    base: LocalCluster, name: str, epochs: int, chaos: Chaos
) -> tuple[list[Any], int, float | None]:
    """Run ``name`` without faults, then with ``chaos``: its table row, the violations of its
    history and the gap between the two final OAs (None when one has none)."""
    reference = one_run(base, base.run_dir / f"{name}-reference", name, epochs)
    faulted = one_run(base, chaos.metrics.parent, name, epochs, chaos)
    found = check_history(read_history(chaos.metrics))
    for violation in found:
        print(f"{name}: violation: {violation}")
    done = faulted.get("finish_reason") == "epochs"
    oas = [(r.get("final") or {}).get("oa") for r in (faulted, reference)]
    kinds = collections.Counter(f["kind"] for f in chaos.faults)
    row = [
        name, epochs, len(chaos.faults), " ".join(f"{k} {n}" for k, n in kinds.items()) or "-",
        f"{faulted.get('restarts', '-')} / {faulted.get('worker_restarts', '-')}",
        faulted.get("versions_replayed", "-"), len(found),
        "yes" if done else f"no: {faulted.get('error', faulted.get('finish_reason'))}"[:60],
        *(f"{oa:.4f}" if oa is not None else "-" for oa in oas),
    ]  # fmt: skip
    return row, len(found), None if None in oas else abs(oas[0] - oas[1])  # type: ignore[operator]


def leftovers(groups: set[int]) -> list[str]:
    """What is left of the runs: processes (this process's children, or anything in a process
    group a run had), this launch's control groups and network namespaces."""
    found = [f"process {p.pid}" for p in psutil.Process().children(recursive=True)]
    for group in sorted(groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, 0)
            found.append(f"process group {group}")
    hierarchy = find_cpu_hierarchy()
    if hierarchy is not None and (hierarchy.mount / f"{PREFIX}{os.getpid()}").exists():
        found.append(f"control group {hierarchy.mount / f'{PREFIX}{os.getpid()}'}")
    if shutil.which("ip"):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        found += [f"namespace {n}" for n in listed.split() if n.startswith(f"pl{os.getpid()}-")]
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the faulted runs and their references, check the histories, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--minutes", type=float, default=20.0, help="faulted training time (default 20)")
    add("--mtbf", type=float, default=45.0, help="mean seconds between faults (default 45)")
    add("--stop-s", type=float, default=30.0, help="seconds a worker stays stopped (default 30)")
    add("--epochs", type=int, default=None, help="epochs per run (default: from --minutes)")
    add("--seed", type=int, default=0, help="seed of the fault draws (default 0)")
    add("--runs", default=",".join(RUNS), help=f"runs to make (default {','.join(RUNS)})")
    add("--out", type=Path, default=ROOT / "runs/bench/chaos", help="output directory")
    add_cluster_arguments(parser)
    args = parse_settings(parser, argv)
    setup_logging("WARNING")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    synth_hsi(args.out / "hsi.h5", bands=16, size=32, classes=4, train_fraction=0.3, seed=0)
    nodes = cluster_from_args(args, worker_count(args, None))
    base = LocalCluster(
        dataset=args.out / "hsi.h5",
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0,) * len(nodes.workers) if nodes else (1.0, 1.0, 2.0),
        run_dir=args.out,
        worker_options=("--threads", "1", "--log-every", "1000000"),
        restarts=1000,
        run_timeout_s=3 * 3600.0,
        nodes=nodes,
        allow_oversubscribe=args.allow_oversubscribe,
    )
    rng = random.Random(args.seed)
    names = [n for n in args.runs.split(",") if n in RUNS]
    rows, faults, groups, violations, gaps = [], [], set(), 0, []
    for name in names:
        epochs = args.epochs
        if epochs is None:  # its share of --minutes, at the pace of a run without faults
            pace = one_run(base, args.out / f"{name}-pace", name, PACE_EPOCHS)
            per_epoch = (pace.get("train_time_s") or 1.0) / PACE_EPOCHS
            epochs = max(PACE_EPOCHS, round(args.minutes * 60 / len(names) / per_epoch))
        metrics = args.out / f"{name}-chaos" / "metrics.jsonl"
        chaos = Chaos(metrics, args.mtbf, stop_s=args.stop_s, rng=rng, shards=RUNS[name][1] > 1)
        row, found, gap = chaos_run(base, name, epochs, chaos)
        rows.append(row)
        violations += found
        gaps += [] if gap is None else [gap]
        groups |= chaos.groups
        faults += [{"run": name, **f} for f in chaos.faults]
    (args.out / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults))
    left = leftovers(groups)
    print(f"chaos: a fault every ~{args.mtbf:g} s (stops of {args.stop_s:g} s); fault log in "
          f"{args.out / 'faults.jsonl'}")  # fmt: skip
    print(format_table(COLUMNS, rows))
    for item in left:
        print(f"left running: {item}")
    kinds = collections.Counter(f["kind"] for f in faults)
    print(f"faults={len(faults)}")
    for kind, figure in (("coordinator", "coordinator_kills"), ("shard", "shard_kills"),
                         ("worker", "worker_kills"), ("stop", "worker_stops")):  # fmt: skip
        print(f"{figure}={kinds[kind]}")
    print(f"violations={violations}")
    print(f"unfinished={sum(row[7] != 'yes' for row in rows)}")
    print(f"max_oa_gap={max(gaps, default=float('nan')):.4f}")
    print(f"leftovers={len(left)}")
    return 0
