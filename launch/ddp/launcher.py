"""``pslaunch ddp``: the torch.distributed DDP baseline on the same data, model and slowdowns.

The launcher starts one process per rank (``python -m launch.ddp.rank``) on 127.0.0.1. It owns
the rendezvous: a ``TCPStore`` bound to port 0 in this process (the kernel picks a free port,
so there is no probe-then-bind race), whose port the ranks are given. With emulated links
(``launch.cluster.netns``) rank i runs on worker i's host and rank 0 hosts the store on its
host's address (a fixed port: nothing else runs in a namespace the launcher built). Rank 0
evaluates after every epoch and writes ``metrics.jsonl`` and ``summary.json`` in the run
directory, in the format the parameter server writes (docs/run-files.md). See
``launch.ddp.step`` for how the emulated slowdown scales compute time only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import socket
import sys
import time
from collections.abc import MutableMapping, Sequence
from typing import Any

from common import rundir
from common.cli_env import child_environment
from common.errors import PSError
from common.procs import Children, TextSink
from common.safefile import write_atomic
from launch.cluster.netns import HOST_INTERFACE, cluster_hosts
from launch.cluster.nodes import Nodes
from launch.cluster.schedule import ScheduleFollower
from launch.ddp import checkpoint
from launch.ddp.config import HOSTED_STORE_PORT, DDPConfig
from launch.ddp.elastic import ElasticGroups
from launch.procs import EventsMark, EventTail, second_signal_kills, signals_interrupt
from launch.progress import RunProgress
from pserver.checkpoint import read_newest, remove_stale_tmp

log = logging.getLogger(__name__)


def use_loopback(env: MutableMapping[str, str]) -> None:
    """Point gloo at the loopback interface (``lo``, ``lo0``), where every rank is, unless
    ``GLOO_SOCKET_IFNAME`` already names one."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
        if names and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = names[0]


def run_ddp(
    config: DDPConfig,
    log_stream: TextSink | None = None,
    progress: RunProgress | None = None,
    rank_module: str = "launch.ddp.rank",
) -> dict[str, Any]:
    """Run every rank to completion and return rank 0's summary.

    On nodes with budget schedules the ranks follow them, and the group restarts from its last
    checkpoint when a node leaves or returns (``launch.ddp.elastic``). If a rank fails, or on
    Ctrl-C, SIGTERM or the run timeout, every rank still running is terminated (then killed
    with its process group) and reaped.

    Args:
        config: what to run.
        log_stream: where the ranks' logs go (default: ``run_dir/cluster.log``).
        progress: a progress bar fed from rank 0's events (none by default).
        rank_module: the module each rank runs (``python -m``); another one must take
            ``launch.ddp.rank``'s arguments (a bench wraps it to change one thing).

    Returns:
        The parsed ``summary.json``.

    Raises:
        ConfigError: the configuration is invalid.
        PSError: a rank failed, the run timed out, or no summary was written.
    """
    from torch.distributed import TCPStore  # torch only when a run starts

    config = _prepare_run_dir(config.validate())
    metrics = config.run_dir / "metrics.jsonl"
    own_log = None
    if log_stream is None:
        log_file = config.run_dir / "cluster.log"
        own_log = log_file.open("a" if config.resume else "w", encoding="utf-8")
        log_stream = own_log
    sink = log_stream
    stores: list[Any] = []  # the rendezvous of the running group
    env = child_environment(os.environ, PYTHONUNBUFFERED="1")
    if config.nodes is not None and config.nodes.links:
        env["GLOO_SOCKET_IFNAME"] = HOST_INTERFACE  # every host's one link
    else:
        use_loopback(env)  # all ranks are on 127.0.0.1
    hosts_scope = contextlib.ExitStack()  # closed after the ranks have been stopped
    budgets = Nodes(config.nodes, server=False, allow_oversubscribe=config.allow_oversubscribe)
    mark = EventsMark(metrics)  # a resumed run's events start after the earlier ones
    groups: ElasticGroups | None = None
    try:
        with signals_interrupt():
            budgets.open()
            if not config.resume:  # an earlier run (--overwrite) or what a failed start left
                rundir.clear(config.run_dir)
            (config.run_dir / "summary.json").unlink(missing_ok=True)  # a resumed run's
            hosts = hosts_scope.enter_context(cluster_hosts(config.nodes))
            nodes = [budgets.worker(i) for i in range(config.world_size)]

            def start(members: Sequence[int], resume: bool) -> Children:
                """The ranks of the nodes ``members`` (rank r on node members[r])."""
                group = dataclasses.replace(config.subset(members), resume=resume)
                remove_stale_tmp(config.run_dir / checkpoint.DIRECTORY)  # a killed rank 0's
                path = config.run_dir / "ddp_config.json"
                path.write_text(group.to_json(), encoding="utf-8")
                rendezvous: list[str] = []
                stores.clear()
                if hosts is not None and group.world_size > 1:
                    port = HOSTED_STORE_PORT + (groups.restarts.count if groups else 0)
                    address = f"{hosts.workers[members[0]].address}:{port}"
                    rendezvous = ["--store", address, "--host-store"]
                elif group.world_size > 1:
                    timeout = datetime.timedelta(seconds=config.startup_timeout_s)
                    store = TCPStore(
                        "127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False
                    )
                    stores.append(store)
                    rendezvous = ["--store", f"127.0.0.1:{store.port}"]
                children = Children(sink, env)
                for rank, index in enumerate(members):
                    cmd = [sys.executable, "-m", rank_module, "--config", str(path)]
                    cmd += ["--rank", str(rank), *rendezvous]
                    cmd = cmd if hosts is None else hosts.workers[index].argv(cmd)
                    children.start(group.rank_name(rank), nodes[index].argv(cmd))
                return children

            tail = EventTail(metrics, mark)
            schedules = [n.schedule for n in config.nodes.workers] if config.nodes else []
            train = config.train
            groups = ElasticGroups(
                follower=ScheduleFollower(
                    schedules, epochs=train.epochs, max_steps=train.max_steps
                ),
                world_size=config.world_size,
                resume=config.resume,
                origin=config.origin,
                start=start,
                budgets=budgets,
                metrics=tail,
            )
            following = progress.follow(metrics, mark) if progress is not None else None
            with following or contextlib.nullcontext():
                restarts = groups.run(config.run_timeout_s)
    except BaseException:
        if groups is not None and groups.group is not None:
            with second_signal_kills(groups.group):
                groups.stop()
        raise
    finally:
        budgets.close()
        mark.close()
        if own_log is not None:
            own_log.close()
        stores.clear()  # closes the rendezvous
        hosts_scope.close()
    summary_path = config.run_dir / "summary.json"
    if not summary_path.exists():
        raise PSError(f"rank 0 wrote no {summary_path}")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    summary["restarts"] = restarts.count
    summary["lost_samples"] = restarts.lost_samples
    summary["restart_s"] = round(restarts.restart_s, 3)
    if config.nodes is not None and config.nodes.scheduled:
        summary["schedule"] = groups.runner.applied if groups is not None else []
    text = json.dumps(summary, indent=2) + "\n"
    write_atomic(summary_path, lambda handle: handle.write(text.encode()))
    return summary


def _prepare_run_dir(config: DDPConfig) -> DDPConfig:
    """Check ``run_dir`` as ``pserver start`` checks its own, before anything is written, and
    create it; returns the configuration with its clock's origin (a resumed run's clock goes
    on from its checkpoint).

    Raises:
        ConfigError: the directory holds a run and neither ``resume`` nor ``overwrite`` was
            given, or ``resume`` finds no readable checkpoint.
    """
    origin = time.monotonic()
    rundir.check(config.run_dir, resume=config.resume, overwrite=config.overwrite)
    if config.resume:
        saved = read_newest(config.run_dir / checkpoint.DIRECTORY)
        origin -= float(saved.meta.get("t", 0.0))
    config.run_dir.mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(config, origin=origin)
