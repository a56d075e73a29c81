"""Cost of watching a run: the TensorBoard sink per run-log event, the server-loop time of one
render of each status-page body with a full live view (the page serves cached bodies from its
own thread), and the training rate of a weighted-sync run unpolled, polled by many clients and
with snapshots every N updates, side by side.

Also the time one snapshot file takes to write (on the server's write thread, not the event
loop) against the median round time, and the time ``pserver evaluate-snapshots`` takes per
snapshot.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import ROOT
from bench.harness.record import parse_settings
from common.data.convert.synth import synth_hsi
from common.procs import Child
from common.training.rounds import round_events
from common.training.runlog import RunLog
from launch.local import LocalCluster, run_local
from pserver.observe import liveview
from pserver.observe.statuspage import BODIES, REFRESH_S, StatusPage
from pserver.snapshots import snapshots as snap
from pserver.snapshots.snapshot_eval import SnapshotEvalConfig, evaluate_snapshots

URL = re.compile(r"status page on (\S+)")
ROUND: dict[str, Any] = {
    "round": 1,
    "epoch": 1,
    "version": 1,
    "round_s": 0.05,
    "workers": [{"worker": f"w{i}", "batch": 16, "speed": 400.0 + i} for i in range(4)],
}


def event_cost(directory: Path, count: int, tensorboard: bool) -> float:
    """Seconds per ``RunLog.event`` call on the caller's thread (a 4-worker round event)."""
    log = RunLog(directory, tensorboard=tensorboard)
    begin = time.perf_counter()
    for _ in range(count):
        log.event("round", **ROUND)
    spent = time.perf_counter() - begin
    log.close()
    return spent / count


def writer_cost(directory: Path, count: int) -> float:
    """Seconds the TensorBoard writer thread spends per 4-worker round event (50 ms apart)."""
    from common.training.tbsink import TensorBoardSink

    sink = TensorBoardSink(directory, max_queue=count + 1)
    begin = time.perf_counter()
    for version in range(count):
        sink._write({"event": "round", "t": 0.05 * version, **ROUND, "version": version})
    spent = time.perf_counter() - begin
    sink.close()
    return spent / count


def request_costs(count: int) -> dict[str, float]:
    """Server-loop seconds per render of each body the page serves (at most one per
    ``REFRESH_S`` and kind, however many requests), with the live view at its bounds."""
    workers = [
        {"id": i, "ready": True, "name": f"w{i}", "device": "cpu", "slowdown": 1.0 + i,
         "speed": 400.0, "samples": 10_000, "pushes": 600, "rejected": 0, "non_finite": 0,
         "active": True}
        for i in range(4)
    ]  # fmt: skip
    status = {"mode": "weighted-sync", "model": "hsi-cnn", "version": 10**5, "epoch": 9,
              "steps": 10**5, "samples_seen": 10**7, "training": True, "finished": False,
              "waiting_for": 0, "last_eval": {"oa": 0.9, "aa": 0.9, "kappa": 0.9, "loss": 0.3},
              "workers": workers}  # fmt: skip
    page = StatusPage(lambda: status, (), clock=lambda: 100.0)
    for i in range(liveview.MAX_EVALS):
        page.on_event({"event": "eval", "t": i, "version": i, "epoch": i, "samples": i,
                       "oa": 0.5, "aa": 0.5, "kappa": 0.5, "loss": 1.0})  # fmt: skip
    for i in range(liveview.MAX_ROUNDS):
        page.on_event({"event": "round", "t": float(i), **ROUND})
    for i in range(liveview.MAX_PUSHES):
        page.on_event({"event": "push", "t": i, "worker": "w1", "batch": 8, "staleness": 1})

    costs = {}
    for name in BODIES:  # what the server's loop spends per refresh of each body
        begin = time.perf_counter()
        for _ in range(count):
            page.render(name)
        costs[name] = (time.perf_counter() - begin) / count
    return costs


class Pollers:
    """A log sink that starts the poller process once the server prints its page URL."""

    def __init__(self, clients: int) -> None:
        self.clients = clients
        self.process: Child | None = None
        self.counts = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        match = URL.search(text)
        with self._lock:
            if match and self.process is None and self.clients:
                url, clients = match.group(1), str(self.clients)
                argv = [sys.executable, "-m", "bench.harness.pollers", url, clients]
                self.process = Child("pollers", argv, cwd=ROOT)
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.process is not None:
            self.process.popen.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
            self.counts = (self.process.output().strip().splitlines() or [""])[-1]


def training_run(
    data: Path, run_dir: Path, options: tuple[str, ...], clients: int
) -> tuple[dict[str, Any], str]:
    """A 2-worker weighted-sync run with its status page on; its summary and the answer counts
    of ``clients`` pollers (none: unpolled)."""
    pollers = Pollers(clients)
    cluster = LocalCluster(
        dataset=data,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 1.0),
        run_dir=run_dir,
        server_options=("--global-batch", "32", "--http", "0", *options),
    )
    try:
        summary = run_local(cluster, log_stream=pollers)
    finally:
        pollers.close()
    return summary, pollers.counts


def write_seconds(state_size: int, count: int = 20) -> float:
    """Median time to write one snapshot of ``state_size`` values."""
    state = np.random.default_rng(0).standard_normal(state_size).astype(np.float32)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for version in range(1, count + 1):
            begin = time.perf_counter()
            snap.write(Path(tmp), state, snap.SnapshotMeta(version, 1, version, 0.1))
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def snapshot_costs(run_dir: Path) -> tuple[float, float, int]:
    """Scoring seconds per snapshot of a run with snapshots, its median round seconds and the
    snapshots' size in values."""
    files = sorted((run_dir / "snapshots").glob("snap-*.npz"))
    begin = time.perf_counter()
    evaluate_snapshots(SnapshotEvalConfig(run_dir, progress=False))
    scoring = (time.perf_counter() - begin) / len(files)
    median_round = statistics.median(e["round_s"] for e in round_events(run_dir))
    return scoring, median_round, snap.read_run_file(run_dir / "snapshots")["state_size"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000, help="run-log events timed")
    parser.add_argument("--clients", type=int, default=200, help="pollers of the status page")
    parser.add_argument("--steps", type=int, default=300, help="updates per training run")
    parser.add_argument("--snapshot-every", type=int, default=1, help="snapshot interval")
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_settings(parser, argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        costs: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats):
            for board in (False, True):
                directory = root / f"events-{board}-{repeat}"
                costs[board].append(event_cost(directory, args.events, board))
        plain, boarded = statistics.median(costs[False]), statistics.median(costs[True])
        print(
            f"RunLog.event, 4-worker round, on the caller's thread: {1e6 * plain:.1f} us "
            f"without TensorBoard, {1e6 * boarded:.1f} us with (ratio {boarded / plain:.2f}; "
            f"medians of {args.repeats}; the writer thread runs meanwhile)"
        )
        written = statistics.median(writer_cost(root / f"w{i}", 3000) for i in range(3))
        print(f"TensorBoard writer thread: {1e6 * written:.0f} us per 4-worker round event")
        print(f"event_us={1e6 * plain:.1f} event_tensorboard_us={1e6 * boarded:.1f}")
        print(f"tensorboard_writer_us={1e6 * written:.0f}")
        print(f"server-loop time per render (at most 1 per {REFRESH_S} s and body), full view:")
        print(" ".join(f"render_{path}_us={1e6 * s:.0f}" for path, s in request_costs(300).items()))
        data = root / "hsi.h5"
        synth_hsi(data, bands=16, size=32, classes=4, train_fraction=0.5, seed=1)
        variants = {
            "unpolled": ((), 0),
            "polled": ((), args.clients),
            "snapshots": (("--snapshot-every-updates", str(args.snapshot_every)), 0),
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        costs_of_snapshots = []
        for repeat in range(args.repeats):
            for name, (options, clients) in variants.items():
                run_dir = root / f"run-{name}-{repeat}"
                summary, counts = training_run(
                    data, run_dir, ("--max-steps", str(args.steps), *options), clients
                )
                runs[name].append(summary)
                rate = summary["samples_seen"] / summary["train_time_s"]
                shown = f", answers {counts}" if clients else ""
                print(f"repeat {repeat + 1}: {name} {rate:.0f} samples/s{shown}", flush=True)
                if name == "snapshots":
                    costs_of_snapshots.append(snapshot_costs(run_dir))
        off, on = (
            statistics.median(s["samples_seen"] / s["train_time_s"] for s in runs[name])
            for name in ("unpolled", "polled")
        )
        print(
            f"weighted-sync, 2 workers: {off:.0f} samples/s unpolled, {on:.0f} with "
            f"{args.clients} pollers of /status.json at 1/s (medians of {args.repeats})"
        )
        print(f"samples_per_s={off:.1f} samples_per_s_polled={on:.1f}")
        print(f"ratio_polled_vs_unpolled={on / off:.3f}")
        pairs = zip(runs["snapshots"], runs["unpolled"], strict=True)
        ratios = [s["train_time_s"] / u["train_time_s"] for s, u in pairs]
        print(f"ratio_train_time_snapshots_vs_off={statistics.median(ratios):.2f}")
        scoring, median_round, state_size = (
            statistics.median(c) for c in zip(*costs_of_snapshots, strict=True)
        )
        write_s = write_seconds(int(state_size))
        print(f"write_ms_per_snapshot={1000 * write_s:.2f} ({int(state_size)} values)")
        print(f"ratio_write_vs_median_round={write_s / median_round:.3f}")
        print(f"evaluate_s_per_snapshot={scoring:.4f}")
