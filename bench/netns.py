"""Emulated hosts for benchmarks: network namespaces behind one bridge, every link capped by tc tbf.

Layout for prefix ``mh`` and N hosts: a switch namespace ``mh-sw`` holding the bridge ``mh-br``
and, per host i, a namespace ``mh-h<i>`` whose only interface ``mh-e<i>`` (address
``<subnet>.<i+1>/24``) is one end of a veth pair; the other end ``mh-p<i>`` sits on the bridge.
A tbf qdisc on ``mh-e<i>`` caps what host i sends and one on ``mh-p<i>`` caps what it receives,
so each host has one full-duplex link at its rate. Nothing is created in the caller's own
namespace, and the private addresses exist only inside these namespaces.

Needs root and iproute2 (``ip``, ``tc``). A file lock stops two runs with the same prefix; a
stale layout left by a crashed run with the same prefix is removed before building.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from common.errors import ConfigError, PSError
from launch.cluster.spec import rate_bits

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 15.0
PREFIX = re.compile(r"^[a-z][a-z0-9]{1,5}$")
LOCK_DIR = Path("/run/lock")


class NetnsError(PSError):
    """Building, using or removing the emulated hosts failed."""


@dataclasses.dataclass(frozen=True)
class NetConfig:
    """The emulated hosts to build.

    Attributes:
        rates: one tc rate per host (host 0 first), e.g. ``("1gbit", "1gbit", "100mbit")``.
        prefix: starts every namespace, bridge and interface name (2-6 lowercase characters).
        subnet: the first three octets of the private /24 used inside the namespaces.
        latency_ms: the tbf queue bound, as the time a full queue takes to drain.
    """

    rates: tuple[str, ...]
    prefix: str = "mh"
    subnet: str = "10.213.0"
    latency_ms: float = 20.0

    def validate(self) -> NetConfig:
        """Check the host count, the rates, the prefix and the subnet.

        Returns:
            The config itself.

        Raises:
            ConfigError: quoting the bad value.
        """
        if not 2 <= len(self.rates) <= 32:
            raise ConfigError(f"need 2 to 32 hosts, got {len(self.rates)}")
        for rate in self.rates:
            rate_bits(rate)
        if not PREFIX.match(self.prefix) or not self.prefix.startswith("mh"):
            raise ConfigError(
                f"prefix must be 2-6 lowercase characters starting 'mh', got {self.prefix!r}"
            )
        octets = self.subnet.split(".")
        private = octets[:1] == ["10"] or octets[:2] == ["192", "168"]
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets) or not private:
            raise ConfigError(
                f"subnet must be a private a.b.c (10.x.y or 192.168.y), got {self.subnet!r}"
            )
        if not 1 <= self.latency_ms <= 1000:
            raise ConfigError(f"latency_ms must be in [1, 1000], got {self.latency_ms}")
        return self


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, interface, address and link rate."""

    index: int
    netns: str
    interface: str
    address: str
    rate: str

    def argv(self, command: Sequence[str]) -> list[str]:
        """The command line that runs ``command`` inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *command]


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command with a timeout; raise NetnsError with its stderr on failure."""
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def available() -> str | None:
    """Why the emulated hosts cannot be built here, or None when they can.

    Returns:
        A one-line reason (not root, ``ip`` or ``tc`` missing), or None.
    """
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 tools missing: {', '.join(missing)}"
    return None


def namespaces(prefix: str) -> list[str]:
    """Names of the existing namespaces that belong to ``prefix`` (``<prefix>-...``)."""
    listing = _run(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [name for name in names if name.startswith(f"{prefix}-")]


def remove(prefix: str) -> list[str]:
    """Kill the processes left in ``prefix``'s namespaces and delete those namespaces.

    Deleting a namespace removes its veth ends, their peers and the bridge with it. Only
    namespaces named ``<prefix>-...`` are touched, and only processes running inside them.

    Args:
        prefix: as in ``NetConfig.prefix``.

    Returns:
        The namespaces that were removed.

    Raises:
        NetnsError: a namespace could not be deleted.
    """
    gone = namespaces(prefix)
    for name in gone:
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", name])
    return gone


class Network:
    """The emulated hosts, built on ``__enter__`` and always removed on ``__exit__``.

    Args:
        config: what to build.

    Raises:
        ConfigError: the config is invalid.
        NetnsError: not root, tools missing, another run holds the prefix, or a command failed.
    """

    def __init__(self, config: NetConfig) -> None:
        self.config = config.validate()
        p, net = config.prefix, config.subnet
        self.switch = f"{p}-sw"
        self.bridge = f"{p}-br"
        self.hosts = [
            Host(i, f"{p}-h{i}", f"{p}-e{i}", f"{net}.{i + 1}", rate)
            for i, rate in enumerate(config.rates)
        ]
        self._lock: IO[str] | None = None

    def __enter__(self) -> Network:
        reason = available()
        if reason:
            raise NetnsError(reason)
        self._acquire()
        try:
            stale = remove(self.config.prefix)
            if stale:
                log.warning("removed a stale layout from an earlier run: %s", ", ".join(stale))
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace of this prefix and release the lock (safe to call twice)."""
        try:
            if self._lock is not None:
                remove(self.config.prefix)
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def _acquire(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        lock = (LOCK_DIR / f"{self.config.prefix}-netns.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.close()
            raise NetnsError(
                f"another run uses the namespace prefix {self.config.prefix!r}"
            ) from exc
        self._lock = lock

    def _build(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", self.bridge, "up"])
        for host in self.hosts:
            port = f"{self.config.prefix}-p{host.index}"
            _run(["ip", "netns", "add", host.netns])
            _run(
                [
                    "ip",
                    "-n",
                    sw,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    host.interface,
                    "netns",
                    host.netns,
                ]
            )
            _run(["ip", "-n", sw, "link", "set", port, "master", self.bridge, "up"])
            _run(
                ["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface]
            )
            _run(["ip", "-n", host.netns, "link", "set", host.interface, "up"])
            _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            self._cap(host.netns, host.interface, host.rate)  # what the host sends
            self._cap(sw, port, host.rate)  # what the host receives
        log.info(
            "built %d hosts behind %s/%s: %s",
            len(self.hosts),
            sw,
            self.bridge,
            ", ".join(f"{h.netns}={h.address}@{h.rate}" for h in self.hosts),
        )

    def _cap(self, netns: str, device: str, rate: str) -> None:
        """A tbf qdisc on ``device``'s egress: bucket of about 1 ms at the rate (>= 32 KiB)."""
        bits = rate_bits(rate)
        burst = max(32 * 1024, bits // 8 // 1000)
        _run(
            [
                "tc",
                "-n",
                netns,
                "qdisc",
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "latency",
                f"{self.config.latency_ms:g}ms",
            ]
        )

    def qdisc_stats(self) -> dict[str, str]:
        """The tc statistics of every capped interface, for a report.

        Returns:
            ``{"<netns>/<device>": tc -s output}``.
        """
        stats = {}
        for host in self.hosts:
            port = f"{self.config.prefix}-p{host.index}"
            for netns, device in ((host.netns, host.interface), (self.switch, port)):
                done = _run(["tc", "-n", netns, "-s", "qdisc", "show", "dev", device], check=False)
                stats[f"{netns}/{device}"] = done.stdout.strip()
        return stats
