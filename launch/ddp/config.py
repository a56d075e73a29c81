"""What ``pslaunch ddp`` runs (``DDPConfig``) and the choices its options take."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.config import default, flag, need
from common.errors import ConfigError
from common.training.slowdown import SlowdownSchedule
from launch.cluster.schedule import OFF
from launch.cluster.spec import ClusterSpec
from launch.settings import TrainSettings
from pserver.config import ServerConfig

BACKENDS = ("auto", "gloo", "nccl")
GRAD_COMPRESSION = ("none", "bf16")
REBALANCE = ("none", "epoch")
CHOICES = {"backend": BACKENDS, "grad_compression": GRAD_COMPRESSION, "rebalance": REBALANCE}
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
    eval_batch: int = default(ServerConfig, "eval_batch")
    cache_mb: int = 1024
    startup_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    run_timeout_s: float = 3600.0
    snapshot_every_steps: int | None = None
    snapshot_limit: int = default(ServerConfig, "snapshot_limit")
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
        need(self.slowdowns, "give at least one rank (--workers or --slowdowns)")
        if self.slowdown_schedules and len(self.slowdown_schedules) != self.world_size:
            raise ConfigError(
                f"{len(self.slowdown_schedules)} slowdown schedules for {self.world_size} ranks"
            )
        for rank in range(self.world_size):
            self.schedule_of(rank)  # factors >= 1, well-formed changes
        need(
            len(self.devices) in (1, self.world_size),
            f"--devices lists {len(self.devices)} devices for {self.world_size} ranks",
        )
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            need(value in choices, f"--{flag(name)} {value!r} is not one of {', '.join(choices)}")
        if self.resolved_backend() == "nccl" and not all(
            self.device_of(r).startswith("cuda") for r in range(self.world_size)
        ):
            raise ConfigError("--backend nccl needs every rank on a CUDA device")
        for name in ("threads", "eval_batch"):
            need(
                getattr(self, name) >= 1,
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}",
            )
        for name in ("startup_timeout_s", "collective_timeout_s", "run_timeout_s"):
            need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        if self.snapshot_every_steps is not None and self.snapshot_every_steps < 1:
            raise ConfigError(
                f"--snapshot-every-steps must be >= 1, got {self.snapshot_every_steps}"
            )
        need(self.snapshot_limit >= 2, f"--snapshot-limit must be >= 2, got {self.snapshot_limit}")
        need(self.dataset.is_file(), f"--dataset {str(self.dataset)!r} does not exist")
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
        if (self.shares or self.rebalance != "none") and not self.weighted:
            raise ConfigError("--shares and --rebalance apply to weighted DDP: add --weighted")
        if self.shares and (
            len(self.shares) != self.world_size
            or not all(0 <= s < math.inf for s in self.shares)
            or not any(self.shares)
        ):
            raise ConfigError(
                f"--shares {','.join(f'{s:g}' for s in self.shares)!r}: give one share >= 0 "
                f"per rank ({self.world_size}), not all 0"
            )
        need(
            self.checkpoint_every >= 1,
            f"--ddp-checkpoint-every must be >= 1, got {self.checkpoint_every}",
        )
        need(not (self.resume and self.overwrite), "give --resume or --overwrite, not both")
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
