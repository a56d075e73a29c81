"""The status-page pollers of ``python -m bench observe``: ``python -m bench.harness.pollers
URL CLIENTS`` keeps CLIENTS keep-alive connections, each asking ``GET /status.json`` once a
second, until SIGTERM, then prints the answers counted by status code. It imports nothing of
the training stack, so the process takes no CPU from the run it polls beyond its polling."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sys
from urllib.parse import urlsplit

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


if __name__ == "__main__":
    print(asyncio.run(poll(sys.argv[1], int(sys.argv[2]))))
