"""The multi-host bench's emulated hosts with capped links (root)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.multihost import start
from bench.multihost.netprobe import measure_rate
from common.procs import Child
from launch.cluster.netns import NetConfig, Network, namespaces
from launch.cluster.spec import rate_bits

pytestmark = pytest.mark.exclusive  # namespaces on a fixed subnet; measures link rates

PREFIX = "mht"  # not the bench's "mh-": a bench run at the same time is left alone


def _all_mh() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.startswith("mh")}


def _qdisc_stats(net: Network) -> dict[str, str]:
    """``tc -s qdisc show`` of both ends of every host's link, by ``<netns>/<device>``."""
    ends = [(h.netns, h.interface) for h in net.hosts]
    ends += [(net.switch, f"{PREFIX}-p{h.index}") for h in net.hosts]
    return {
        f"{netns}/{device}": subprocess.run(
            ["tc", "-n", netns, "-s", "qdisc", "show", "dev", device],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        for netns, device in ends
    }


def test_capped_link_and_teardown(netns_ok: None, tmp_path: Path) -> None:
    before = _all_mh()
    # A stale namespace from a "crashed" earlier run with this prefix is removed at start.
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-h7"], check=True, timeout=10)
    cap = rate_bits("50mbit")
    try:
        with Network(
            NetConfig(rates=("50mbit", "50mbit"), prefix=PREFIX, subnet="10.214.0")
        ) as net:
            assert f"{PREFIX}-h7" not in namespaces(PREFIX)
            assert set(namespaces(PREFIX)) == {f"{PREFIX}-sw", f"{PREFIX}-h0", f"{PREFIX}-h1"}
            a, b = net.hosts
            up = measure_rate(a, b, 3_000_000, tmp_path, timeout=60)
            down = measure_rate(b, a, 3_000_000, tmp_path, timeout=60)
            stats = _qdisc_stats(net)
        # TCP payload stays under the cap (headers take ~3 %); far below would mean a broken link.
        for rate in (up, down):
            assert 0.6 * cap < rate < 1.02 * cap, (up, down, stats)
        assert all("tbf" in text and "rate 50Mbit" in text for text in stats.values()), stats
    finally:
        subprocess.run(["ip", "netns", "del", f"{PREFIX}-h7"], capture_output=True, timeout=10)
    assert namespaces(PREFIX) == []
    assert _all_mh() == before


def test_teardown_on_failure(netns_ok: None, tmp_path: Path) -> None:
    sleeper: Child | None = None
    try:
        with (
            pytest.raises(RuntimeError, match="boom"),
            Network(NetConfig(rates=("1gbit", "1gbit", "1gbit"), prefix=PREFIX)) as net,
        ):
            assert len(namespaces(PREFIX)) == 4
            # A process left running inside a host is killed with its namespace.
            argv = net.hosts[1].argv(["sh", "-c", "echo ready; exec sleep 300"])
            sleeper = start("sleeper", argv, tmp_path / "sleeper.log")
            sleeper.wait_for_match("^ready$", 30)
            raise RuntimeError("boom")
        assert namespaces(PREFIX) == []
        assert sleeper is not None and sleeper.wait(timeout=10) == -9
    finally:
        if sleeper is not None:
            sleeper.stop()
