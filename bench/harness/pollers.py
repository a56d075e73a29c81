"""The status-page pollers of ``python -m bench observe``: ``python -m bench.harness.pollers
URL CLIENTS`` keeps CLIENTS keep-alive connections, each asking ``GET /status.json`` once a
second, until SIGTERM, then prints the answers counted by status code. It imports nothing of
the training stack, so the process takes no CPU from the run it polls beyond its polling."""

from __future__ import annotations

import collections
import http.client
import random
import signal
import sys
import threading
from urllib.parse import urlsplit

PERIOD_S = 1.0
TIMEOUT_S = 10.0


def _client(host: str, port: int, counts: collections.Counter[str], stop: threading.Event) -> None:
    """One poller: a keep-alive connection (opened again after a failure or a close), one GET
    /status.json a second."""
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    stop.wait(random.uniform(0, PERIOD_S))
    while not stop.is_set():
        try:
            conn.request("GET", "/status.json")
            with conn.getresponse() as response:
                response.read()
            key = str(response.status)
        except (OSError, http.client.HTTPException):
            key = "failed"
            conn.close()
        counts[key] += 1
        stop.wait(PERIOD_S)
    conn.close()


def poll(url: str, clients: int) -> dict[str, int]:
    """Poll until SIGTERM; the answers counted by status code."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    counts = [collections.Counter[str]() for _ in range(clients)]  # one per thread
    threads = [
        threading.Thread(target=_client, args=(parts.hostname, parts.port, mine, stop))
        for mine in counts
    ]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(TIMEOUT_S + PERIOD_S)
    return dict(sum(counts, collections.Counter[str]()))


if __name__ == "__main__":
    print(poll(sys.argv[1], int(sys.argv[2])))
