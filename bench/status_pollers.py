"""Training rate with many status-page pollers, against the same run unpolled, side by side.

Each run is a weighted-sync run of 2 workers with the status page on (``--http 0``); in the
polled runs a separate process keeps ``--clients`` keep-alive connections, each asking for
``/status.json`` once a second (the page's own rate) from a random phase. Runs alternate
(unpolled, polled) ``--repeats`` times; the figure is the ratio of the training rates
(samples applied per second of training time, medians over repeats).

Usage: python -m bench status-pollers [--clients 200] [--steps 300] [--repeats 3]
       python -m bench status-pollers --poll URL [--clients 200]   (the poller process)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import ROOT
from bench.harness.record import parse_settings

URL = re.compile(r"status page on (\S+)")
PERIOD_S = 1.0


async def _client(host: str, port: int, counts: dict[str, int], stop: asyncio.Event) -> None:
    """One poller: a keep-alive connection, one GET /status.json a second."""
    request = f"GET /status.json HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    await asyncio.sleep(random.uniform(0, PERIOD_S))
    reader = writer = None
    while not stop.is_set():
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            assert reader is not None
            writer.write(request)
            status = (await asyncio.wait_for(reader.readline(), 10)).split(b" ")[1:2]
            length = 0
            while (line := await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                if line.lower().startswith(b"connection: close"):
                    assert writer is not None
                    writer.close()
                    writer = None
            if reader is not None and length:
                await asyncio.wait_for(reader.readexactly(length), 10)
            key = status[0].decode() if status else "none"
            counts[key] = counts.get(key, 0) + 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            counts["failed"] = counts.get("failed", 0) + 1
            if writer is not None:
                writer.close()
            writer = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PERIOD_S)
    if writer is not None:
        writer.close()


async def poll(url: str, clients: int) -> dict[str, int]:
    """Poll until SIGTERM; the answers counted by status code."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    counts: dict[str, int] = {}
    await asyncio.gather(
        *(_client(parts.hostname, parts.port, counts, stop) for _ in range(clients))
    )
    return counts


class Pollers:
    """A log sink that starts the poller process once the server prints its page URL."""

    def __init__(self, clients: int) -> None:
        self.clients = clients
        self.process: Any = None  # the poller process (common.procs.Child)
        self.counts = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        from common.procs import Child

        match = URL.search(text)
        with self._lock:
            if match and self.process is None and self.clients:
                command = [sys.executable, "-m", "bench.status_pollers", "--poll", match.group(1)]
                argv = [*command, "--clients", str(self.clients)]
                self.process = Child("pollers", argv, cwd=ROOT)
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.process is not None:
            self.process.popen.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
            self.counts = (self.process.output().strip().splitlines() or [""])[-1]


def training_rate(data: Path, run_dir: Path, steps: int, clients: int) -> tuple[float, str]:
    """Samples applied per second of training time, and the pollers' answer counts."""
    from launch.local import LocalCluster, run_local

    pollers = Pollers(clients)
    cluster = LocalCluster(
        dataset=data,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 1.0),
        run_dir=run_dir,
        server_options=("--max-steps", str(steps), "--global-batch", "32", "--http", "0"),
    )
    try:
        summary = run_local(cluster, log_stream=pollers)
    finally:
        pollers.close()
    return summary["samples_seen"] / summary["train_time_s"], pollers.counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--poll", default=None, help=argparse.SUPPRESS)
    args = parse_settings(parser, argv)
    if args.poll:
        print(asyncio.run(poll(args.poll, args.clients)))
        return
    from common.data.convert.synth import synth_hsi  # (the poller process imports none of this)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "hsi.h5"
        synth_hsi(data, bands=16, size=32, classes=4, train_fraction=0.5, seed=1)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats):
            for polled in (False, True):
                run_dir = root / f"run-{polled}-{repeat}"
                rate, counts = training_rate(
                    data, run_dir, args.steps, args.clients if polled else 0
                )
                rates[polled].append(rate)
                shown = f", answers {counts}" if polled else ""
                print(f"repeat {repeat + 1}: {'polled' if polled else 'unpolled'} {rate:.0f} "
                      f"samples/s{shown}", flush=True)  # fmt: skip
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(
            f"weighted-sync, 2 workers: {off:.0f} samples/s unpolled, {on:.0f} with "
            f"{args.clients} pollers of /status.json at 1/s (medians of {args.repeats}); "
            f"ratio {on / off:.2f}"
        )
        print(f"samples_per_s={off:.1f} samples_per_s_polled={on:.1f}")
        print(f"ratio_polled_vs_unpolled={on / off:.3f}")


if __name__ == "__main__":
    main()
