"""Cost of watching a run: the TensorBoard sink per run-log event, the server-loop time of one
render of each status-page body with a full live view (the page serves cached bodies from its
own thread; bench/status_pollers.py measures many pollers), and sync round time while the page
is polled 10 times a second (ten times the page's own rate), in one run.

Usage: python -m bench observe [--events 20000] [--rounds 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness.record import parse_settings
from common.data.convert.synth import synth_hsi
from common.training.runlog import RunLog
from launch.local import LocalCluster, run_local
from pserver.observe import liveview
from pserver.observe.statuspage import BODIES, REFRESH_S, StatusPage

WARMUP = 10
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
    page = StatusPage(lambda: status, (), lambda: 100.0)
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


class Poller:
    """A log sink that, once the server prints its page URL, polls it until stopped."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.stop = threading.Event()
        self.requests = 0
        self.thread: threading.Thread | None = None

    def write(self, text: str) -> int:
        match = URL.search(text)
        if match and self.thread is None:
            self.thread = threading.Thread(target=self._poll, args=(match.group(1),))
            self.thread.start()
        return len(text)

    def flush(self) -> None:
        pass

    def _poll(self, url: str) -> None:
        while not self.stop.wait(self.period_s):
            try:
                for path in ("status.json", "history.json"):
                    with urllib.request.urlopen(url + path, timeout=5) as response:
                        response.read()
                    self.requests += 1
            except OSError:
                return  # the server has gone

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(10)


def median_round(data: Path, run_dir: Path, rounds: int, polled: bool) -> tuple[float, int]:
    """Median round time of a weighted-sync run (after warm-up) and the page requests made."""
    options = ["--max-steps", str(rounds), "--global-batch", "32"]
    if polled:
        options += ["--http", "0"]
    poller = Poller(0.1)
    cluster = LocalCluster(
        dataset=data,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 2.0),
        run_dir=run_dir,
        server_options=tuple(options),
    )
    try:
        run_local(cluster, log_stream=poller)
    finally:
        poller.close()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(x)["round_s"] for x in lines if '"event": "round"' in x][WARMUP:]
    return statistics.median(times), poller.requests


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=300)
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
        render_costs = request_costs(300)
        print(
            f"server-loop time per render (at most 1 per {REFRESH_S} s and body), live view full: "
            + ", ".join(f"{path} {1e6 * cost:.0f} us" for path, cost in render_costs.items())
        )
        data = root / "hsi.h5"
        synth_hsi(data, bands=16, size=32, classes=4, train_fraction=0.5, seed=1)
        rounds: dict[bool, list[float]] = {False: [], True: []}
        requests = []
        for repeat in range(args.repeats):
            for polled in (False, True):
                run_dir = root / f"run-{polled}-{repeat}"
                median, made = median_round(data, run_dir, args.rounds, polled)
                rounds[polled].append(median)
                if polled:
                    requests.append(made)
        off, on = statistics.median(rounds[False]), statistics.median(rounds[True])
        print(
            f"weighted-sync median round: {1000 * off:.2f} ms without the page, "
            f"{1000 * on:.2f} ms polled 10/s ({min(requests)}-{max(requests)} requests per run); "
            f"ratio {on / off:.2f}"
        )
        print(f"round_ms={1000 * off:.2f} round_polled_ms={1000 * on:.2f}")
        print(f"ratio_round_polled_vs_off={on / off:.3f}")


if __name__ == "__main__":
    main()
