"""Where a weighted-sync round's time goes: sampled stacks of a real server and worker.

Both processes' main threads are sampled with py-spy (wall clock: idle time included) and every
sample sorted into a stage of the round; a stage's share of its thread's samples times the
median round time gives its milliseconds per round. Each process's CPU time per round (from
/proc) is shared out over its busy stages the same way: CPU times, unlike wall-clock shares, do
not grow when other processes compete for the cores.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from bench import ROOT
from bench.harness.jasper import jasper
from bench.harness.record import parse_settings
from bench.harness.served import served_run
from common.data import JASPER_DIR
from common.polling import poll_until
from launch.procs import new_events

# (stage, markers): a sample belongs to the first stage with a marker in its stack, markers
# tried innermost frame first. Order matters: more specific stages come first.
WORKER_STAGES = [
    (
        "push: encode + send gradient",
        (
            "OverlappedPush._send",
            "StoreClient.send_chunk",
            "StoreClient.encode_whole",
            "Replica.gradient_on_host",
        ),
    ),
    ("backward", ("Tensor.backward",)),
    ("forward + loss", ("Replica.compute",)),
    ("fused params: receive + decode", ("StoreClient.collect", "StoreClient.load_whole")),
    ("load params into the model", ("Replica.ensure_params",)),
    ("data hand-off (prefetched batch)", ("Replica.batch",)),
    ("wait for the server's reply", ("Poller.poll",)),
    ("push request: encode + parse reply", ("Connection.request",)),
]
WAITING = ("idle (event loop waits)", "wait for the server's reply")  # no CPU spent
CPU_ROUNDS = 200  # rounds over which CPU time is measured, before sampling
SERVER_STAGES = [
    ("idle (event loop waits)", ("EpollSelector.select",)),
    ("data requests (prefetch)", ("DataRequests.data",)),
    (
        "stage gradient: decode + checks",
        ("StoreService.on_gradient_chunk", "StoreService.on_gradient_push"),
    ),
    ("accumulate + optimizer step + checks", ("SliceStore.prepare",)),
    ("snapshot/publish + reply params", ("StoreService.publish",)),
    ("refit speed models (after the reply)", ("SyncRounds.settle",)),
    ("book the round (metrics, ledger)", ("Ledger.book",)),
    ("plan + task reply", ("ModePolicy.after_update", "TaskDesk.send", "TaskDesk.dispatch")),
    ("push request checks", ("Pushes.push",)),
    ("receive + decode requests", ("Endpoint.receive_loop",)),
]


def classify(
    path: Path, stages: list[tuple[str, tuple[str, ...]]]
) -> tuple[collections.Counter[str], int]:
    """Samples per stage of the main thread in a py-spy raw (collapsed) file."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not frames[0].startswith(("<module>", "_run_module_as_main")):
            continue  # another thread
        total += int(n)
        names = [f.split(" (")[0] for f in reversed(frames)]
        stage = next(
            (s for name in names for s, marks in stages if name in marks), "other (Python glue)"
        )
        if names[0] == "Runner.run":  # uvloop waits in C code, under its runner's frame
            stage = stages[0][0]
        counts[stage] += int(n)
    return counts, total


def wait_rounds(metrics: Path, count: int, timeout_s: float) -> list[dict]:
    """Round events once at least ``count`` were written."""

    def rounds() -> list[dict] | None:
        found = [r for r in new_events(metrics, 0) if r.get("event") == "round"]
        return found if len(found) >= count else None

    return poll_until(rounds, timeout_s, 0.2, f"{count} rounds") if count else rounds() or []


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def profile(tree: Path, dataset: Path, tmp: Path, seconds: int, rate: int) -> dict[str, Any]:
    """Run a server and one worker with the code in ``tree``; sample both for ``seconds``.

    Returns:
        ``round_ms`` (median), per process ``{stage: ms per round}`` and ``cpu_ms`` per round.
    """
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    steps = 200 + CPU_ROUNDS + seconds * 400  # more than the window can use at 2.5 ms a round
    options = [
        *("--dataset", str(dataset), "--model", "hsi-cnn", "--mode", "weighted-sync"),
        *("--workers", "1", "--global-batch", "64", "--eval-every", "1000000"),
        *("--max-steps", str(steps)),
    ]
    run_dir = tmp / f"run-{tree.name}"
    with served_run(tree, run_dir, options, 1, start_timeout_s=60, stop_grace_s=10) as run:
        begin = len(wait_rounds(run.metrics, 100, 120))
        procs = {"server": run.server, "worker": run.workers[0]}
        cpu0 = {name: cpu_s(proc.pid) for name, proc in procs.items()}
        before = len(wait_rounds(run.metrics, begin + CPU_ROUNDS, 600))  # before py-spy slows it
        cpu = {name: cpu_s(proc.pid) - cpu0[name] for name, proc in procs.items()}
        spies = [
            run.children.start(
                f"py-spy {name}",
                [
                    *(spy, "record", "--idle", "-p", str(proc.pid), "-r", str(rate)),
                    *("-d", str(seconds), "-f", "raw", "-o", str(tmp / f"{name}.raw")),
                ],
            )
            for name, proc in procs.items()
        ]
        for spy_proc in spies:
            spy_proc.wait(timeout=seconds + 60)
        rounds = wait_rounds(run.metrics, before + 1, 10)[before:]
    result: dict[str, Any] = {
        "round_ms": statistics.median(r["round_s"] for r in rounds) * 1e3,
        "cpu_ms": {name: c / (before - begin) * 1e3 for name, c in cpu.items()},
    }
    for name, stages in (("worker", WORKER_STAGES), ("server", SERVER_STAGES)):
        counts, total = classify(tmp / f"{name}.raw", stages)
        order = [s for s, _ in stages] + ["other (Python glue)"]
        result[name] = {s: counts[s] / max(total, 1) * result["round_ms"] for s in order}
        busy = [s for s in order if s not in WAITING]
        share = result["cpu_ms"][name] / max(sum(counts[s] for s in busy), 1)
        result[f"{name} cpu"] = {s: counts[s] * share for s in busy}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rate", type=int, default=400)
    parser.add_argument("--jasper", type=Path, default=JASPER_DIR)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    args = parse_settings(parser, argv)
    trees = {"this": ROOT}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        dataset = jasper(tmp, jasper_dir=args.jasper)
        results = {
            name: profile(tree, dataset, tmp, args.seconds, args.rate)
            for name, tree in trees.items()
        }
    names = list(results)
    print("ms per round" + "".join(f"{n:>10s}" for n in names))
    print(f"{'median round':42s}" + "".join(f"{results[n]['round_ms']:10.2f}" for n in names))
    print(f"round_ms={results['this']['round_ms']:.2f}")
    for proc in ("worker", "server"):
        print(
            f"{proc + ' CPU time (all threads)':42s}"
            + "".join(f"{results[n]['cpu_ms'][proc]:10.2f}" for n in names)
        )
        for kind, what in ((proc, "main thread, wall clock"), (f"{proc} cpu", "CPU by stage")):
            print(f"{proc} {what}:")
            for stage in results[names[0]][kind]:
                print(f"  {stage:40s}" + "".join(f"{results[n][kind][stage]:10.2f}" for n in names))
