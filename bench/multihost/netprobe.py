"""Measure a link: a bounded bulk TCP transfer between two emulated hosts.

Run inside the namespaces by ``measure_rate``; the receiver binds port 0, prints its port, and
reports the bytes received and the seconds from the first byte to the end of the stream:
``python -m bench.multihost.netprobe recv ADDRESS`` /
``python -m bench.multihost.netprobe send ADDRESS PORT BYTES``.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

from bench.multihost import start
from common.procs import Child, ChildError, python_module
from launch.cluster.netns import Host

SOCKET_TIMEOUT_S = 30.0
CHUNK = 1 << 20


def receive(address: str) -> None:
    """Accept one connection on ``address``:0, read it to the end, print a JSON result line."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind((address, 0))
        server.listen(1)
        server.settimeout(SOCKET_TIMEOUT_S)
        print(f"port {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(SOCKET_TIMEOUT_S)
            buf = bytearray(CHUNK)
            total, first = 0, None
            while True:
                got = conn.recv_into(buf)
                if not got:
                    break
                if first is None:
                    first = time.perf_counter()
                total += got
            seconds = time.perf_counter() - first if first is not None else 0.0
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def send(address: str, port: int, size: int) -> None:
    """Connect to ``address:port`` and send ``size`` bytes."""
    chunk = b"\0" * CHUNK
    with socket.create_connection((address, port), timeout=SOCKET_TIMEOUT_S) as conn:
        left = size
        while left > 0:
            conn.sendall(chunk[: min(left, CHUNK)])
            left -= min(left, CHUNK)


def measure_rate(src: Host, dst: Host, size: int, log_dir: Path, timeout: float = 60.0) -> float:
    """Send ``size`` bytes from ``src`` to ``dst`` and return the achieved payload rate.

    Args:
        src, dst: two hosts of one ``Network``.
        size: bytes to send (>= 1 MiB gives a steady rate past the bucket's burst).
        log_dir: receives the two processes' logs.
        timeout: seconds the whole transfer may take.

    Returns:
        TCP payload bits per second, first byte to last (headers excluded, so a little below
        the cap).

    Raises:
        ChildError: a process failed or the transfer took longer than ``timeout``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    recv = start(
        f"recv@{dst.netns}",
        dst.argv(python_module("bench.multihost.netprobe", "recv", dst.address)),
        log_dir / f"probe-recv-{dst.netns}.log",
    )
    sender: Child | None = None
    try:
        port = recv.wait_for_match(r"^port (\d+)$", timeout).group(1)
        argv = src.argv(
            python_module("bench.multihost.netprobe", "send", dst.address, port, str(size))
        )
        sender = start(f"send@{src.netns}", argv, log_dir / f"probe-send-{src.netns}.log")
        if sender.wait(timeout) != 0:
            raise ChildError(f"the sender failed\n{sender.tail()}")
        result = json.loads(recv.wait_for_match(r"^\{.*\}$", timeout).group(0))
    finally:
        if sender is not None:
            sender.stop()
        recv.stop()
    if result["bytes"] != size or result["seconds"] <= 0:
        raise ChildError(f"received {result['bytes']} of {size} bytes")
    return result["bytes"] * 8 / result["seconds"]


def main(argv: list[str]) -> int:
    """The child-side entry point: ``recv ADDRESS`` or ``send ADDRESS PORT BYTES``."""
    if len(argv) == 2 and argv[0] == "recv":
        receive(argv[1])
        return 0
    if len(argv) == 4 and argv[0] == "send":
        send(argv[1], int(argv[2]), int(argv[3]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
