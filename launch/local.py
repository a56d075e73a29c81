"""A local cluster: one server process, K parameter shard processes and N worker processes on
127.0.0.1, or each on its own emulated host and link (``launch.cluster.netns``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import rundir
from common.cli_env import child_environment
from common.config import need
from common.data.dataset import DatasetReader
from common.errors import ConfigError, PSError
from common.procs import Children, TextSink, python_module
from common.protocol.security import write_shard_secret
from common.safefile import write_atomic
from launch.cluster.netns import Host, Placement, cluster_hosts
from launch.cluster.nodes import Nodes
from launch.cluster.schedule import ScheduleFollower, ScheduleRunner
from launch.cluster.spec import ClusterSpec
from launch.procs import (
    EventsMark,
    EventTail,
    second_signal_kills,
    signals_interrupt,
)
from launch.progress import RunProgress
from launch.restarts import Supervisor, restart_due
from pserver.config import ServerConfig

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN_S = 15.0  # beyond the server's --shutdown-timeout, before it is killed
ENDING_S = 30.0  # how long workers and shards may take to exit after the server has
FLAGS = ("resume", "overwrite")  # the run-folder options, passed on to the server
REPLACED = tuple(f"--{flag}" for flag in FLAGS)  # server options a restart's own replace


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """What ``pslaunch local`` runs.

    Attributes:
        dataset, model, mode: as for ``pserver start``.
        slowdowns: one slowdown factor per worker.
        run_dir: the server's run directory (metrics.jsonl, summary.json, logs).
        server_options: further ``pserver start`` options, e.g. ``["--epochs", "5"]``.
        devices: one device per worker (``cpu``, ``cuda:N``), or one for all.
        slowdown_schedules: per worker, ``STEP:F,...`` changes of its slowdown ("" for none).
        worker_options: further ``worker join`` options for every worker.
        shards: parameter shards; K > 1 starts K ``pserver shard`` processes beside the server
            (which becomes their coordinator), 1 keeps the parameters in the server.
        startup_timeout_s: how long the server may take to start listening.
        run_timeout_s: how long the whole run may take before it is stopped.
        nodes: the emulated cluster; with links, the server, every worker and every shard
            run on their own hosts (None: all on 127.0.0.1); with CPU budgets, each in its own
            CPU-quota control group (``launch.cluster.budgets``).
        allow_oversubscribe: run budgets that sum to more cores than the machine has.
        resume, overwrite: continue the run in ``run_dir``, or replace it (``common.rundir``;
            also given as ``--resume``/``--overwrite`` among the server options).
        restarts: how often a server that dies (with its shards), and each worker that dies,
            is started again (``launch.restarts``; 0: never).
    """

    dataset: Path
    model: str
    mode: str
    slowdowns: tuple[float, ...]
    run_dir: Path
    server_options: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    slowdown_schedules: tuple[str, ...] = ()
    worker_options: tuple[str, ...] = ()
    shards: int = 1
    startup_timeout_s: float = 120.0
    run_timeout_s: float = 3600.0
    nodes: ClusterSpec | None = None
    allow_oversubscribe: bool = False
    resume: bool = False
    overwrite: bool = False
    restarts: int = 3

    def validate(self) -> LocalCluster:
        """Check the worker list.

        Raises:
            ConfigError: no workers, a slowdown below 1, a device list of the wrong length,
                fewer than 1 shard, ``--shards`` among the server options, or restarts < 0.
        """
        need(self.restarts >= 0, f"--restarts must be >= 0, got {self.restarts}")
        need(self.slowdowns, "give at least one worker")
        if any(s < 1 for s in self.slowdowns):
            raise ConfigError(f"slowdowns must be >= 1, got {list(self.slowdowns)}")
        if self.slowdown_schedules and len(self.slowdown_schedules) != len(self.slowdowns):
            raise ConfigError(
                f"{len(self.slowdown_schedules)} slowdown schedules for "
                f"{len(self.slowdowns)} workers"
            )
        need(
            len(self.devices) in (1, len(self.slowdowns)),
            f"--devices lists {len(self.devices)} devices for {len(self.slowdowns)} workers",
        )
        need(self.shards >= 1, f"--shards must be >= 1, got {self.shards}")
        if any(o == "--shards" or o.startswith("--shards=") for o in self.server_options):
            raise ConfigError("give the shard count as pslaunch's --shards, which starts them")
        if self.nodes is not None and len(self.nodes.workers) != len(self.slowdowns):
            raise ConfigError(
                f"the emulated cluster has {len(self.nodes.workers)} worker nodes for "
                f"{len(self.slowdowns)} workers"
            )
        return self

    def folder_flags(self) -> dict[str, bool]:
        """``resume`` and ``overwrite``, given as fields or among the server options."""
        return {f: getattr(self, f) or f"--{f}" in self.server_options for f in FLAGS}

    def check(self) -> Nodes:
        """Everything a launch can refuse, checked before anything is written: the worker
        list, the run folder (``common.rundir``) and the CPU budgets.

        Returns:
            The nodes, opened (close them).

        Raises:
            ConfigError: as ``validate``; the folder holds a run and neither ``resume`` nor
                ``overwrite`` was given; the budgets cannot be had.
        """
        self.validate()
        flags = self.folder_flags()
        rundir.check(self.run_dir, resume=flags["resume"], overwrite=flags["overwrite"])
        shards = self.shards if self.shards > 1 else 0
        return Nodes(self.nodes, shards=shards, allow_oversubscribe=self.allow_oversubscribe).open()


def run_local(
    cluster: LocalCluster,
    log_stream: TextSink | None = None,
    progress: RunProgress | None = None,
) -> dict[str, Any]:
    """Run the server, its shards and the workers to completion and return the summary.

    What dies meanwhile is restarted (``launch.restarts``). Ctrl-C (or any error) sends SIGTERM
    to the server, which tells the workers and shards to stop; all processes are waited for,
    and killed if they outlive their timeout.

    Args:
        cluster: what to run.
        log_stream: where the processes' logs go (default: ``run_dir/cluster.log``).
        progress: a progress bar fed from the run's events while it trains (none by default).

    Returns:
        The parsed ``summary.json``.

    Raises:
        ConfigError: as ``LocalCluster.check`` (then nothing was written).
        PSError: the server failed to start, a process failed (the server with no restart
            left), or no summary was written.
    """
    budgets = cluster.check()
    cluster.run_dir.mkdir(parents=True, exist_ok=True)
    own_log = None
    if log_stream is None:
        mode = "a" if cluster.folder_flags()["resume"] else "w"
        log_stream = own_log = (cluster.run_dir / "cluster.log").open(mode, encoding="utf-8")
    sink = log_stream
    secret_dir = Path(tempfile.mkdtemp(prefix="pslaunch-")) if cluster.shards > 1 else None
    secret = None if secret_dir is None else write_shard_secret(secret_dir / "shard.secret")
    children = Children(sink, child_environment(os.environ, PYTHONUNBUFFERED="1"))
    marks: list[EventsMark] = []
    hosts_scope = contextlib.ExitStack()  # closed after the children have been stopped
    supervisor: Supervisor | None = None
    try:
        with signals_interrupt():
            hosts = hosts_scope.enter_context(cluster_hosts(cluster.nodes))
            metrics = cluster.run_dir / "metrics.jsonl"
            marks.append(EventsMark(metrics))
            supervisor = Supervisor(
                children=children,
                run_dir=cluster.run_dir,
                restarts=cluster.restarts,
                server_argv=lambda extra: budgets.server().argv(
                    _server_command(cluster, secret, hosts, extra)
                ),
                shard_argvs=lambda address: [
                    (n, budgets.shard(i).argv(c))
                    for i, (n, c) in enumerate(_shards(cluster, address, hosts, secret))
                ],
                startup_timeout_s=cluster.startup_timeout_s,
                marks=marks,
                set_budget=budgets.set_budget,
            )
            following = progress.follow(metrics, marks[0]) if progress is not None else None
            with following or contextlib.nullcontext():
                address = supervisor.start_server()
                supervisor.start_workers(
                    [
                        (n, budgets.worker(i).argv(c))
                        for i, (n, c) in enumerate(_workers(cluster, address, hosts))
                    ]
                )
                runner = _schedule(cluster, supervisor)
                if runner is not None:
                    tail = EventTail(metrics, marks[0])
                    supervisor.tick = lambda: runner.step(tail.read())
                code = supervisor.wait(cluster.run_timeout_s)
            if code == 0:
                supervisor.stop_unjoined()
                children.wait_all(ENDING_S)  # workers and shards end when the server does
            children.stop()  # any straggler is stopped
    except BaseException:
        server = None if supervisor is None else supervisor.server
        budget = _option(cluster.server_options, "--shutdown-timeout")  # how long it may stop
        grace = ServerConfig.shutdown_timeout_s if budget is None else float(budget)
        with second_signal_kills(children):
            children.stop(server, first_grace_s=grace + SHUTDOWN_MARGIN_S)
        raise
    finally:
        children.close()
        budgets.close()
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)
        for mark in marks:
            mark.close()
        if own_log is not None:
            own_log.close()
        hosts_scope.close()
    assert supervisor.server is not None
    if code != 0:
        spent = f"; no restart left (--restarts {cluster.restarts})" if restart_due(code) else ""
        raise PSError(f"{supervisor.server.failure()}{spent}")
    failed = [w.code for w in supervisor.workers]
    for index, worker in enumerate(supervisor.workers):
        if worker.code and index not in supervisor.away:
            log.warning("%s during the run; the server went on without it", worker.failure())
    shard_codes = [s.code for s in supervisor.shards]
    if any(shard_codes):
        log.warning("shard exit codes: %s", shard_codes)
    summary_path = cluster.run_dir / "summary.json"
    if not summary_path.exists():
        raise PSError(f"the server wrote no {summary_path}")
    applied = None if runner is None else runner.applied
    summary = _record(summary_path, cluster, {**supervisor.record(), "schedule": applied})
    summary["worker_exit_codes"] = failed
    if supervisor.shards:
        summary["shard_exit_codes"] = shard_codes
    return summary


def _record(summary_path: Path, cluster: LocalCluster, launch: dict[str, Any]) -> dict[str, Any]:
    """The run's summary with what the server cannot know written into it: the restarts, the
    schedule changes applied (``schedule``, None without schedules) and, on an emulated
    cluster, each worker's ``cpus``, ``schedule`` and ``link``."""
    summary = {**json.loads(summary_path.read_text(encoding="utf-8")), **launch}
    if summary["schedule"] is None:
        del summary["schedule"]
    if cluster.nodes is not None:
        names = {name: i for i, (name, _) in enumerate(_workers(cluster, "-", None))}
        for worker in summary.get("workers", []):
            index = names.get(worker.get("name"))
            if index is not None:
                node = cluster.nodes.workers[index].describe()
                worker.update({k: node[k] for k in ("cpus", "schedule", "link")})
        summary["cluster"] = cluster.nodes.describe()
    text = json.dumps(summary, indent=2) + "\n"
    write_atomic(summary_path, lambda handle: handle.write(text.encode()))
    return summary


def _on(host: Host | None, argv: list[str]) -> list[str]:
    """``argv`` as run on ``host`` (None: on this machine)."""
    return argv if host is None else host.argv(argv)


def _bind(host: Host | None) -> str:
    """An endpoint on ``host``'s address (None: 127.0.0.1), port picked by the kernel."""
    return f"tcp://{'127.0.0.1' if host is None else host.address}:0"


def _server_command(
    cluster: LocalCluster,
    secret: Path | None,
    hosts: Placement | None = None,
    restart: Sequence[str] = (),
) -> list[str]:
    """``pserver start``'s command line; a restart's options (``restart``) replace any
    ``--resume`` or ``--overwrite`` the cluster's options hold."""
    host = None if hosts is None else hosts.server
    options = [o for o in cluster.server_options if not restart or o not in REPLACED]
    args = ["--bind", _bind(host), "--dataset", str(cluster.dataset), "--model", cluster.model]
    args += ["--mode", cluster.mode, "--workers", str(len(cluster.slowdowns))]
    args += ["--run-dir", str(cluster.run_dir)]
    if cluster.shards > 1:
        args += ["--shards", str(cluster.shards)]
    if secret is not None:
        args += ["--shard-secret-file", str(secret)]
    args += _checkpoints(cluster)
    if not restart:  # a restart's own options replace the folder flags
        args += [f"--{f}" for f in FLAGS if getattr(cluster, f)]
    return _on(host, python_module("pserver.cli", "start", *args, *options, *restart))


def _shards(
    cluster: LocalCluster, address: str, hosts: Placement | None, secret: Path | None
) -> list[tuple[str, list[str]]]:
    """(name, ``pserver shard`` command line) per shard; none unless ``shards`` > 1. With
    hosts, shard i runs beside worker i mod N, bound to that host's address. Each proves
    ``secret`` to the coordinator."""
    if cluster.shards < 2 or secret is None:
        return []
    commands = []
    for i in range(cluster.shards):
        host = None if hosts is None else hosts.shard(i)
        args = ["--coordinator", address, "--bind", _bind(host), "--name", f"shard{i}"]
        args += ["--secret-file", str(secret)]
        commands.append((f"shard{i}", _on(host, python_module("pserver.cli", "shard", *args))))
    return commands


def _workers(
    cluster: LocalCluster, address: str, hosts: Placement | None
) -> list[tuple[str, list[str]]]:
    """(name, ``worker join`` command line) per worker, each on its host when there are hosts."""
    commands = []
    for i, slowdown in enumerate(cluster.slowdowns):
        device = cluster.devices[i if len(cluster.devices) > 1 else 0]
        name = worker_name(
            i, slowdown, None if cluster.nodes is None else cluster.nodes.workers[i].cpus
        )
        schedule = cluster.slowdown_schedules[i] if cluster.slowdown_schedules else ""
        args = ["--server", address, "--device", device, "--slowdown", str(slowdown)]
        args += ["--name", name, "--slowdown-schedule", schedule]
        if ":" in cluster.model:  # a user model: the worker must be allowed to import it
            args += ["--allow-model", cluster.model]
        argv = python_module("worker.cli", "join", *args, *cluster.worker_options)
        commands.append((name, _on(None if hosts is None else hosts.workers[i], argv)))
    return commands


def worker_name(index: int, slowdown: float, cores: float | None) -> str:
    """A worker's name: ``w<index>-<cores>c`` on a node with a CPU budget (its starting
    budget, e.g. ``w3-0.1c``), followed by ``-x<slowdown>`` when it is slowed too; else
    ``w<index>-x<slowdown>`` (``w1-x2``)."""
    if cores is None:
        return f"w{index}-x{slowdown:g}"
    return f"w{index}-{cores:g}c" + (f"-x{slowdown:g}" if slowdown != 1 else "")


def _schedule(cluster: LocalCluster, actions: Supervisor) -> ScheduleRunner | None:
    """The runner of the workers' schedules (None: no node has one)."""
    if cluster.nodes is None or not cluster.nodes.scheduled:
        return None
    epochs, steps = (_option(cluster.server_options, o) for o in ("--epochs", "--max-steps"))
    follower = ScheduleFollower(
        [n.schedule for n in cluster.nodes.workers],
        epochs=None if epochs is None else int(epochs),
        max_steps=None if steps is None else int(steps),
    )
    return ScheduleRunner(follower, actions)


def _checkpoints(cluster: LocalCluster) -> tuple[str, ...]:
    """With restarts and no ``--checkpoint-every`` given: a checkpoint every ceil(train / B)
    updates (once an epoch in sync modes), so a restarted server loses at most that."""
    options = cluster.server_options
    if not cluster.restarts or _option(options, "--checkpoint-every") is not None:
        return ()
    batch = int(_option(options, "--global-batch") or ServerConfig.global_batch)
    try:
        with DatasetReader(cluster.dataset, cache_bytes=0) as reader:
            train = len(reader.train_indices)
    except PSError:  # the server says what is wrong with it
        return ()
    return ("--checkpoint-every", str(-(-train // batch)))


def _option(options: Sequence[str], name: str) -> str | None:
    """The value of option ``name`` in a command line's ``options`` (the last given), or None."""
    value = None
    for i, option in enumerate(options):
        if option == name and i + 1 < len(options):
            value = options[i + 1]
        elif option.startswith(name + "="):
            value = option.split("=", 1)[1]
    return value
