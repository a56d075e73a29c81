"""A host and a capped link per node (``--links``): the launchers run every process on its own
emulated host, and every namespace, veth, bridge and process is gone after a run, whether it
ends, fails or is stopped (root)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from bench.multihost.netprobe import measure_rate
from common.errors import PSError
from launch.cluster import netns
from launch.cluster.netns import NetnsError, cluster_hosts, namespaces, remove_stale_launches
from launch.cluster.spec import parse_cluster, rate_bits
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.local import LocalCluster, run_local
from launch.settings import TrainSettings
from tests.support.launches import start_pslaunch, stop_launcher, wait_for_training

WAIT_S = 120.0


def _layout(pid: int) -> list[str]:
    """The namespaces of the launcher run with ``pid`` (their veths and bridge go with them)."""
    return namespaces(f"pl{pid}")


def _links() -> set[str]:
    """Interfaces in this (the root) namespace: a launcher run must add none."""
    listing = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    return {line.split(":")[1].strip() for line in listing.stdout.splitlines()}


def _cluster(dataset: Path, run_dir: Path, **changes: object) -> LocalCluster:
    settings: dict[str, object] = {
        "dataset": dataset,
        "model": "hsi-cnn",
        "mode": "weighted-sync",
        "slowdowns": (1.0, 2.0),
        "run_dir": run_dir,
        "server_options": ("--epochs", "1", "--shutdown-timeout", "30"),
        "startup_timeout_s": WAIT_S,
        "run_timeout_s": WAIT_S,
        "nodes": parse_cluster(2, links="100mbit"),
    }
    settings.update(changes)
    return LocalCluster(**settings)  # type: ignore[arg-type]


@pytest.mark.exclusive  # measures a rate; fixed-subnet namespaces
def test_links_cap_a_bulk_transfer_both_ways(netns_ok: None, tmp_path: Path) -> None:
    spec = parse_cluster(2, links="50mbit", server_link="50mbit")
    with cluster_hosts(spec) as hosts:
        assert hosts is not None
        assert len(_layout(os.getpid())) == 4  # switch, server and two workers
        worker, server = hosts.workers[0], hosts.server
        up = measure_rate(worker, server, 3_000_000, tmp_path, timeout=60)
        down = measure_rate(server, worker, 3_000_000, tmp_path, timeout=60)
    cap = rate_bits("50mbit")
    for rate in (up, down):  # TCP payload: the cap less ~3 % of headers
        assert 0.9 * cap <= rate <= 1.01 * cap, (up, down)
    assert _layout(os.getpid()) == []


@pytest.mark.exclusive  # namespaces on a fixed subnet
def test_pslaunch_local_trains_across_hosts(
    netns_ok: None, small_hsi: Path, tmp_path: Path
) -> None:
    before = _links()
    summary = run_local(_cluster(small_hsi, tmp_path, shards=2))
    assert summary["epochs"] == 1 and summary["worker_exit_codes"] == [0, 0]
    assert summary["shard_exit_codes"] == [0, 0]
    assert all(w["samples"] > 0 for w in summary["workers"])
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The server listened on its own host's address, not on loopback.
    assert next(e["address"] for e in events if e["event"] == "start").startswith(
        f"tcp://{netns.LAUNCH_SUBNET}.1:"
    )
    assert _layout(os.getpid()) == [] and _links() == before


@pytest.mark.exclusive  # namespaces on a fixed subnet
def test_pslaunch_ddp_trains_across_hosts(netns_ok: None, small_hsi: Path, tmp_path: Path) -> None:
    config = DDPConfig(
        dataset=small_hsi,
        model="hsi-cnn",
        slowdowns=(1.0, 1.0),
        run_dir=tmp_path,
        train=TrainSettings(epochs=1),
        startup_timeout_s=WAIT_S,
        run_timeout_s=WAIT_S,
        nodes=parse_cluster(2, links="100mbit"),
    )
    summary = run_ddp(config)
    assert summary["epochs"] == 1 and summary["final"]["oa"] > 0
    assert _layout(os.getpid()) == []


@pytest.mark.exclusive  # namespaces on a fixed subnet
def test_a_failing_worker_leaves_no_layout(netns_ok: None, small_hsi: Path, tmp_path: Path) -> None:
    """The only worker asks for CUDA on a machine without it and exits at once."""
    one = {"slowdowns": (1.0,), "nodes": parse_cluster(1, links="100mbit")}
    cluster = _cluster(small_hsi, tmp_path, devices=("cuda:0",), **one)
    with pytest.raises(PSError, match=r"w0-x1 exited with code 1: .*CUDA"):
        run_local(cluster)
    assert _layout(os.getpid()) == []


def _processes_in(names: list[str]) -> list[str]:
    pids = []
    for name in names:
        done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        pids += done.stdout.split()
    return pids


@pytest.mark.exclusive  # namespaces on a fixed subnet
def test_sigterm_to_pslaunch_removes_hosts_and_processes(
    netns_ok: None, small_hsi: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = ["local", "--dataset", str(small_hsi)]
    argv += ["--model", "hsi-cnn", "--mode", "async", "--slowdowns", "1,2", "--epochs", "1000"]
    argv += ["--run-dir", str(run_dir), "--links", "100mbit", "--no-progress"]
    argv += ["--server-opt=--shutdown-timeout=30"]
    launcher = start_pslaunch(*argv)
    try:
        wait_for_training(run_dir, launcher, WAIT_S)
        layout = _layout(launcher.pid)
        assert len(layout) == 4 and len(_processes_in(layout)) == 3  # server, 2 workers
    except BaseException:
        launcher.kill()
        raise
    code = stop_launcher(launcher, lambda: launcher.popen.send_signal(signal.SIGTERM), WAIT_S)
    assert code == 130, launcher.output()
    assert _layout(launcher.pid) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finish_reason"] == "stopped"


@pytest.mark.exclusive  # removes every stale launch's namespaces
def test_a_dead_runs_layout_is_removed(netns_ok: None) -> None:
    dead = 4_194_000  # above any pid this machine hands out (pid_max is at most 4194304)
    name = f"pl{dead}-h0"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert name in remove_stale_launches()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    assert _layout(dead) == []


@pytest.mark.exclusive  # namespaces on a fixed subnet
def test_link_delay_is_applied_or_refused_in_one_line(netns_ok: None) -> None:
    spec = parse_cluster(2, links="1gbit", link_delay="5ms")
    try:
        with cluster_hosts(spec) as hosts:
            assert hosts is not None
            out = subprocess.run(
                ["tc", "-n", hosts.server.netns, "qdisc", "show", "dev", netns.HOST_INTERFACE],
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
            assert "tbf" in out and "netem" in out and "delay 5ms" in out, out
    except NetnsError as exc:  # this kernel has no netem (checked before anything runs)
        assert "--link-delay needs the kernel's netem qdisc" in str(exc)
        assert "\n" not in str(exc)
    assert _layout(os.getpid()) == []


def test_not_root_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with (
        pytest.raises(NetnsError, match=r"^--links: network namespaces need root$"),
        cluster_hosts(parse_cluster(2, links="1gbit")),
    ):
        pass


def test_no_links_builds_nothing() -> None:
    with cluster_hosts(parse_cluster(2, node_cpus="0.5")) as hosts:
        assert hosts is None
    with cluster_hosts(None) as hosts:
        assert hosts is None


def test_the_link_options_reach_every_launcher(small_hsi: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from launch.cli import local_cluster
    from launch.cli import main as pslaunch

    args = ["--dataset", str(small_hsi), "--model", "hsi-cnn", "--run-dir", "r"]
    args += ["--slowdowns", "1,2,2", "--links", "1gbit,1gbit,100mbit", "--epochs", "1"]
    ctx = pslaunch.commands["local"].make_context("local", args)
    ctx.params.pop("progress")
    cluster, _ = local_cluster(**ctx.params)
    assert cluster.nodes is not None
    assert [n.link for n in cluster.nodes.workers] == ["1gbit", "1gbit", "100mbit"]
    assert cluster.nodes.server.link == "1gbit"  # the fastest worker link
    base = ["--dataset", str(small_hsi), "--model", "hsi-cnn", "--epochs", "1"]
    base += ["--slowdowns", "1,2", "--links", "1gbit,1gbit,1gbit"]
    for command, out in (("ddp", "--run-dir"), ("compare", "--out"), ("local", "--run-dir")):
        result = CliRunner().invoke(pslaunch, [command, *base, out, str(tmp_path / command)])
        assert result.exit_code == 2, result.output
        assert "--links '1gbit,1gbit,1gbit' has 3 entries for 2 workers" in result.output
