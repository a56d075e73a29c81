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
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import rundir
from common.cli_env import child_environment
from common.errors import ConfigError, PSError
from common.procs import Children, TextSink
from common.safefile import write_atomic
from common.training.slowdown import SlowdownSchedule
from launch.cluster.netns import HOST_INTERFACE, cluster_hosts
from launch.cluster.nodes import Nodes
from launch.cluster.schedule import OFF, ScheduleFollower
from launch.cluster.spec import ClusterSpec
from launch.ddp import checkpoint
from launch.ddp.elastic import ElasticGroups
from launch.procs import EventsMark, second_signal_kills, signals_interrupt
from launch.progress import EventTail, RunProgress
from launch.settings import TrainSettings, server_default
from pserver.checkpoint import read_newest, remove_stale_tmp

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
GRAD_COMPRESSION = ("none", "bf16")
REBALANCE = ("none", "epoch")
HOSTED_STORE_PORT = 29500  # rank 0's store on its emulated host


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """What ``pslaunch ddp`` runs.

    Attributes:
        dataset, model: as for ``pserver start``.
        slowdowns: one slowdown factor per rank (the number of ranks).
        run_dir: where rank 0 writes metrics.jsonl and summary.json (and cluster.log goes).
        train: the hyperparameters shared with the parameter-server modes.
        slowdown_schedules: per rank, ``STEP:F,...`` changes of its slowdown ("" for none).
        devices: one device per rank (``cpu``, ``cuda:N``), or one for all.
        backend: ``gloo``, ``nccl``, or ``auto`` (nccl when every rank is on CUDA, else gloo).
        threads: torch CPU threads per rank (parameter-server workers use 1 by default).
        eval_batch: evaluation batch size on rank 0.
        cache_mb: a rank keeps the sample array in memory when it is at most this large.
        startup_timeout_s: how long ranks may take to meet at the rendezvous.
        collective_timeout_s: how long a rank waits in one collective (rank 0 evaluates while
            the others wait, so this bounds an evaluation too).
        run_timeout_s: how long the whole run may take before it is stopped.
        snapshot_every_steps: rank 0 saves every N-th step's state to ``run_dir/snapshots``
            for ``pserver evaluate-snapshots`` (None: off).
        snapshot_limit: snapshots kept at most (``pserver start --snapshot-limit``).
        nodes: the emulated cluster; with links, every rank runs on its own host (the host
            of the worker it stands for) and link (None: all on 127.0.0.1).
        allow_oversubscribe: run budgets that sum to more cores than the machine has.
        grad_compression: ``none``, or ``bf16``: the gradients travel as bfloat16 through
            PyTorch's ``bf16_compress_hook`` on DDP's reducer.
        weighted: weighted DDP: each rank's local batch is proportional to its speed and the
            gradients are combined as sum_r (b_r / B) g_r (False: plain DDP, equal batches).
        shares: weighted DDP's given speeds, one per rank (>= 0; empty: measured at start).
        rebalance: ``none`` or ``epoch`` (re-split by the last epoch's step times).
        names: the ranks' names in the records (empty: ``r<rank>-x<slowdown>``).
        checkpoint_every: rank 0 writes a checkpoint every this many epochs (and when
            stopped by a signal) to ``run_dir/checkpoints``.
        resume: continue the run in ``run_dir`` from its newest checkpoint.
        overwrite: replace a run ``run_dir`` holds (without it, or ``resume``, one is refused).
        origin: the run's start on the monotonic clock, which rank 0's events count from
            (set by the launcher; None: rank 0's own start).
    """

    dataset: Path
    model: str
    slowdowns: tuple[float, ...]
    run_dir: Path
    train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
    slowdown_schedules: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    backend: str = "auto"
    threads: int = 1
    eval_batch: int = server_default("eval_batch")
    cache_mb: int = 1024
    startup_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    run_timeout_s: float = 3600.0
    snapshot_every_steps: int | None = None
    snapshot_limit: int = server_default("snapshot_limit")
    nodes: ClusterSpec | None = None
    allow_oversubscribe: bool = False
    grad_compression: str = "none"
    weighted: bool = False
    shares: tuple[float, ...] = ()
    rebalance: str = "none"
    names: tuple[str, ...] = ()
    checkpoint_every: int = 1
    resume: bool = False
    overwrite: bool = False
    origin: float | None = None

    @property
    def mode(self) -> str:
        """``ddp`` or ``weighted-ddp``, as the records name the run."""
        return "weighted-ddp" if self.weighted else "ddp"

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.slowdowns)

    def device_of(self, rank: int) -> str:
        """The device spec of ``rank``."""
        return self.devices[rank if len(self.devices) > 1 else 0]

    def resolved_backend(self) -> str:
        """``gloo`` or ``nccl``: what ``auto`` means for these devices."""
        if self.backend != "auto":
            return self.backend
        cuda = all(self.device_of(r).startswith("cuda") for r in range(self.world_size))
        return "nccl" if cuda else "gloo"

    def schedule_of(self, rank: int) -> SlowdownSchedule:
        """The slowdown schedule of ``rank``."""
        changes = self.slowdown_schedules[rank] if self.slowdown_schedules else ""
        return SlowdownSchedule(self.slowdowns[rank], changes)

    def rank_name(self, rank: int) -> str:
        """The rank's name in metrics (like a worker's ``w0-x1``)."""
        return self.names[rank] if self.names else f"r{rank}-x{self.slowdowns[rank]:g}"

    def subset(self, ranks: Sequence[int]) -> DDPConfig:
        """The same run on the ranks ``ranks`` only, which keep their names, slowdowns,
        devices, shares and nodes."""

        def pick(values: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(values[r] for r in ranks) if len(values) > 1 else values

        nodes = self.nodes
        if nodes is not None:
            nodes = dataclasses.replace(nodes, workers=pick(nodes.workers))
        return dataclasses.replace(
            self,
            slowdowns=pick(self.slowdowns),
            slowdown_schedules=pick(self.slowdown_schedules),
            devices=pick(self.devices),
            shares=pick(self.shares),
            names=tuple(self.rank_name(r) for r in ranks),
            nodes=nodes,
        )

    def validate(self) -> DDPConfig:
        """Check every field.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        self.train.validate()
        if not self.slowdowns:
            raise ConfigError("give at least one rank (--workers or --slowdowns)")
        if self.slowdown_schedules and len(self.slowdown_schedules) != self.world_size:
            raise ConfigError(
                f"{len(self.slowdown_schedules)} slowdown schedules for {self.world_size} ranks"
            )
        for rank in range(self.world_size):
            self.schedule_of(rank)  # factors >= 1, well-formed changes
        if len(self.devices) not in (1, self.world_size):
            raise ConfigError(
                f"--devices lists {len(self.devices)} devices for {self.world_size} ranks"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.resolved_backend() == "nccl" and not all(
            self.device_of(r).startswith("cuda") for r in range(self.world_size)
        ):
            raise ConfigError("--backend nccl needs every rank on a CUDA device")
        for name in ("threads", "eval_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("startup_timeout_s", "collective_timeout_s", "run_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.snapshot_every_steps is not None and self.snapshot_every_steps < 1:
            raise ConfigError(
                f"--snapshot-every-steps must be >= 1, got {self.snapshot_every_steps}"
            )
        if self.snapshot_limit < 2:
            raise ConfigError(f"--snapshot-limit must be >= 2, got {self.snapshot_limit}")
        if not self.dataset.is_file():
            raise ConfigError(f"--dataset {str(self.dataset)!r} does not exist")
        if self.nodes is not None and len(self.nodes.workers) != self.world_size:
            raise ConfigError(
                f"the emulated cluster has {len(self.nodes.workers)} worker nodes for "
                f"{self.world_size} ranks"
            )
        if self.nodes is not None and all(
            any(c.action == OFF for c in n.schedule) for n in self.nodes.workers
        ):
            raise ConfigError(
                "every node's schedule takes it off: a DDP group restarts on the nodes left, "
                "so keep one node on throughout"
            )
        if self.grad_compression not in GRAD_COMPRESSION:
            raise ConfigError(
                f"--grad-compression {self.grad_compression!r} is not one of "
                f"{', '.join(GRAD_COMPRESSION)}"
            )
        if (self.shares or self.rebalance != "none") and not self.weighted:
            raise ConfigError("--shares and --rebalance apply to weighted DDP: add --weighted")
        if self.rebalance not in REBALANCE:
            raise ConfigError(f"--rebalance {self.rebalance!r} is not one of none, epoch")
        if self.shares and (
            len(self.shares) != self.world_size
            or not all(0 <= s < math.inf for s in self.shares)
            or not any(self.shares)
        ):
            raise ConfigError(
                f"--shares {','.join(f'{s:g}' for s in self.shares)!r}: give one share >= 0 "
                f"per rank ({self.world_size}), not all 0"
            )
        if self.checkpoint_every < 1:
            raise ConfigError(f"--ddp-checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.resume and self.overwrite:
            raise ConfigError("give --resume or --overwrite, not both")
        if self.names and len(self.names) != self.world_size:
            raise ConfigError(f"{len(self.names)} rank names for {self.world_size} ranks")
        return self

    def to_json(self) -> str:
        """The configuration as JSON (what the rank processes read)."""
        data = dataclasses.asdict(self)
        data["dataset"], data["run_dir"] = str(self.dataset), str(self.run_dir)
        data["nodes"] = None if self.nodes is None else self.nodes.describe()
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> DDPConfig:
        """Parse ``to_json``'s output.

        Raises:
            ConfigError: the text is not such a configuration.
        """
        try:
            data = json.loads(text)
            data["dataset"], data["run_dir"] = Path(data["dataset"]), Path(data["run_dir"])
            data["train"] = TrainSettings(**data["train"])
            for key in ("slowdowns", "slowdown_schedules", "devices", "shares", "names"):
                data[key] = tuple(data[key])
            if data.get("nodes") is not None:
                data["nodes"] = ClusterSpec.from_description(data["nodes"])
            return cls(**data)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"not a DDP configuration: {exc}") from exc


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo``, ``lo0``) for gloo, if there is one."""
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


def _rank_env(links: bool = False) -> dict[str, str]:
    env = child_environment(os.environ, PYTHONUNBUFFERED="1")
    if links:
        env["GLOO_SOCKET_IFNAME"] = HOST_INTERFACE  # every host's one link
    elif "GLOO_SOCKET_IFNAME" not in env:
        loopback = _loopback_interface()
        if loopback:
            env["GLOO_SOCKET_IFNAME"] = loopback  # all ranks are on 127.0.0.1
    return env


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
    env = _rank_env(config.nodes is not None and config.nodes.links)
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
            watch = (
                progress.follow(metrics, mark) if progress is not None else contextlib.nullcontext()
            )
            with watch:
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
