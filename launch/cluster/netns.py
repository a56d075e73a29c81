"""Emulated hosts: network namespaces behind one bridge, every link capped both ways by tc tbf.

Layout for prefix ``p`` and N hosts: a switch namespace ``p-sw`` holding the bridge ``p-br``
and, per host i, a namespace ``p-h<i>`` whose only interface ``link0`` (address
``<subnet>.<i+1>/24``) is one end of a veth pair; the other end ``p-p<i>`` sits on the bridge.
A tbf qdisc on ``link0`` caps what host i sends and one on ``p-p<i>`` caps what it receives, so
each host has one full-duplex link at its rate. A link delay, where asked, is a netem qdisc
under each tbf (so host to host, a packet crosses two links and is delayed twice); kernels
without netem refuse it (tbf's ``latency`` only bounds its queue: it adds no delay). Nothing is
created in the caller's own namespace, and the private addresses exist only inside these
namespaces, so two runs never clash on addresses.

``cluster_hosts`` places a launcher's processes: the server on host 0, worker (or DDP rank) i
on host i + 1, shard j on the host of worker j mod N. Launcher runs use the prefix
``pl<pid>``; a layout whose run died without removing it (its lock is free) is removed by the
next launcher run.

Needs root and iproute2 (``ip``, ``tc``). A file lock per prefix stops two runs sharing one; a
stale layout with the same prefix is removed before building.
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
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from common.config import need
from common.errors import ConfigError, PSError
from launch.cluster.spec import ClusterSpec, delay_ms, rate_bits

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 15.0
PREFIX = re.compile(r"^[a-z][a-z0-9]{1,9}$")
LAUNCH_PREFIX = re.compile(r"^pl(\d+)-")
LOCK_DIR = Path("/run/lock")
HOST_INTERFACE = "link0"  # the same name in every host, so one GLOO_SOCKET_IFNAME fits all
LAUNCH_SUBNET = "10.215.0"
NO_DELAY = "--link-delay needs the kernel's netem qdisc, which this kernel lacks ({error})"


class NetnsError(PSError):
    """Building, using or removing the emulated hosts failed."""


@dataclasses.dataclass(frozen=True)
class NetConfig:
    """The emulated hosts to build.

    Attributes:
        rates: one tc rate per host (host 0 first), e.g. ``("1gbit", "1gbit", "100mbit")``.
        prefix: starts every namespace, bridge and port name (2-10 lowercase characters).
        subnet: the first three octets of the private /24 used inside the namespaces.
        latency_ms: the tbf queue bound, as the time a full queue takes to drain.
        delay: one-way delay added on every link in each direction (``2ms``), None for none.
    """

    rates: tuple[str, ...]
    prefix: str = "mh"
    subnet: str = "10.213.0"
    latency_ms: float = 20.0
    delay: str | None = None

    def validate(self) -> NetConfig:
        """Check the host count, the rates, the prefix, the subnet and the delay.

        Returns:
            The config itself.

        Raises:
            ConfigError: quoting the bad value.
        """
        need(2 <= len(self.rates) <= 32, f"need 2 to 32 hosts, got {len(self.rates)}")
        for rate in self.rates:
            rate_bits(rate)
        need(
            PREFIX.match(self.prefix),
            f"prefix must be 2-10 lowercase characters, got {self.prefix!r}",
        )
        octets = self.subnet.split(".")
        private = octets[:1] == ["10"] or octets[:2] == ["192", "168"]
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets) or not private:
            raise ConfigError(
                f"subnet must be a private a.b.c (10.x.y or 192.168.y), got {self.subnet!r}"
            )
        need(
            1 <= self.latency_ms <= 1000, f"latency_ms must be in [1, 1000], got {self.latency_ms}"
        )
        if self.delay is not None:
            delay_ms(self.delay)
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
        """The command line that runs ``command`` inside this host's namespace (``ip netns
        exec`` execs it, so the process keeps the pid it was started with)."""
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


def _all_namespaces() -> list[str]:
    listing = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def namespaces(prefix: str) -> list[str]:
    """Names of the existing namespaces that belong to ``prefix`` (``<prefix>-...``)."""
    return [name for name in _all_namespaces() if name.startswith(f"{prefix}-")]


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


def _lock_path(prefix: str) -> Path:
    return LOCK_DIR / f"{prefix}-netns.lock"


def remove_stale_launches() -> list[str]:
    """Remove the layouts of launcher runs that ended without removing them.

    A launcher layout (``pl<pid>-...``) is stale when no process holds its lock.

    Returns:
        The namespaces that were removed.

    Raises:
        NetnsError: a namespace could not be deleted.
    """
    prefixes = sorted({m.group(0)[:-1] for n in _all_namespaces() if (m := LAUNCH_PREFIX.match(n))})
    gone: list[str] = []
    for prefix in prefixes:
        path = _lock_path(prefix)
        with path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run holds it
            gone += remove(prefix)
            path.unlink(missing_ok=True)
    if gone:
        log.warning("removed the layout of a launcher run that died: %s", ", ".join(gone))
    return gone


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back within the block (main thread), so building or removing
    the layout is never cut short; a signal that came meanwhile is handled after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Network:
    """The emulated hosts, built on ``__enter__`` and always removed on ``__exit__``.

    Args:
        config: what to build.

    Raises:
        ConfigError: the config is invalid.
        NetnsError: not root, tools missing, another run holds the prefix, a delay was asked
            on a kernel without netem, or a command failed.
    """

    def __init__(self, config: NetConfig) -> None:
        self.config = config.validate()
        p, net = config.prefix, config.subnet
        self.switch = f"{p}-sw"
        self.bridge = f"{p}-br"
        self.hosts = [
            Host(i, f"{p}-h{i}", HOST_INTERFACE, f"{net}.{i + 1}", rate)
            for i, rate in enumerate(config.rates)
        ]
        self._lock: IO[str] | None = None

    def __enter__(self) -> Network:
        reason = available()
        if reason:
            raise NetnsError(reason)
        try:  # a signal held back while building is raised at the block's end: close then
            with _signals_held():
                self._acquire()
                stale = remove(self.config.prefix)
                if stale:
                    log.warning("removed a stale layout from an earlier run: %s", ", ".join(stale))
                self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace of this prefix and release the lock (safe to call twice)."""
        with _signals_held():
            try:
                if self._lock is not None:
                    remove(self.config.prefix)
            finally:
                if self._lock is not None:
                    _lock_path(self.config.prefix).unlink(missing_ok=True)
                    self._lock.close()
                    self._lock = None

    def _acquire(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        lock = _lock_path(self.config.prefix).open("a")
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
        if self.config.delay is not None:
            self._check_delay()
        _run(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", self.bridge, "up"])
        for host in self.hosts:
            port = f"{self.config.prefix}-p{host.index}"
            _run(["ip", "netns", "add", host.netns])
            veth = ["ip", "-n", sw, "link", "add", port, "type", "veth"]
            _run([*veth, "peer", "name", host.interface, "netns", host.netns])
            _run(["ip", "-n", sw, "link", "set", port, "master", self.bridge, "up"])
            address = f"{host.address}/24"
            _run(["ip", "-n", host.netns, "addr", "add", address, "dev", host.interface])
            _run(["ip", "-n", host.netns, "link", "set", host.interface, "up"])
            _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            self._cap(host.netns, host.interface, host.rate)  # what the host sends
            self._cap(sw, port, host.rate)  # what the host receives
        log.info(
            "built %d hosts behind %s/%s: %s%s",
            len(self.hosts),
            sw,
            self.bridge,
            ", ".join(f"{h.netns}={h.address}@{h.rate}" for h in self.hosts),
            f", {self.config.delay} per link" if self.config.delay else "",
        )

    def _check_delay(self) -> None:
        """Refuse a delay in one line where the kernel has no netem qdisc."""
        probe = ["tc", "-n", self.switch, "qdisc", "add", "dev", "lo", "root", "netem"]
        done = _run([*probe, "delay", "1ms"], check=False)
        if done.returncode != 0:
            raise NetnsError(NO_DELAY.format(error=done.stderr.strip() or done.returncode))
        _run(["tc", "-n", self.switch, "qdisc", "del", "dev", "lo", "root"])

    def _cap(self, netns: str, device: str, rate: str) -> None:
        """A tbf qdisc on ``device``'s egress: bucket of about 1 ms at the rate (>= 32 KiB);
        a netem delay under it when the config asks for one."""
        bits = rate_bits(rate)
        burst = max(32 * 1024, bits // 8 // 1000)
        qdisc = ["tc", "-n", netns, "qdisc", "replace", "dev", device]
        latency = f"{self.config.latency_ms:g}ms"
        tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", latency]
        _run([*qdisc, "root", "handle", "1:", *tbf])
        if self.config.delay is not None:
            _run([*qdisc, "parent", "1:1", "handle", "10:", "netem", "delay", self.config.delay])


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which emulated host each process of a launcher's run is on.

    Attributes:
        server: the coordinator's host (host 0).
        workers: per worker (or DDP rank), its host.
    """

    server: Host
    workers: tuple[Host, ...]

    def shard(self, index: int) -> Host:
        """The host of shard ``index``: co-located with worker ``index`` mod N."""
        return self.workers[index % len(self.workers)]


def launch_config(spec: ClusterSpec, pid: int | None = None) -> NetConfig:
    """The hosts a launcher run builds for ``spec``: the server's, then one per worker.

    Args:
        spec: the emulated cluster (every worker and the server have a link).
        pid: names the layout ``pl<pid>`` (default: this process's).

    Raises:
        ConfigError: the spec gives a node no link.
    """
    links = (spec.server.link, *(node.link for node in spec.workers))
    if any(link is None for link in links):
        raise ConfigError("every node needs a link: give --links (and --server-link)")
    return NetConfig(
        rates=tuple(link for link in links if link is not None),
        prefix=f"pl{os.getpid() if pid is None else pid}",
        subnet=LAUNCH_SUBNET,
        delay=spec.link_delay,
    ).validate()


@contextlib.contextmanager
def cluster_hosts(spec: ClusterSpec | None) -> Iterator[Placement | None]:
    """The hosts of ``spec``'s nodes for the block, removed at its end whatever happens.

    Yields None (and builds nothing) when ``spec`` is None or gives no links, so a launcher
    can always enter it.

    Args:
        spec: the emulated cluster.

    Yields:
        Where the server, each worker and each shard run.

    Raises:
        NetnsError: in one line: not root, iproute2 missing, no netem for a delay, or a
            command failed.
    """
    if spec is None or not spec.links:
        yield None
        return
    reason = available()
    if reason:
        raise NetnsError(f"--links: {reason}")
    remove_stale_launches()
    with Network(launch_config(spec)) as net:
        yield Placement(server=net.hosts[0], workers=tuple(net.hosts[1:]))
