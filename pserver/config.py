"""The server's and the shard's validated configurations; their defaults live here only."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import socket
from pathlib import Path

from common.config import flag, need
from common.errors import ConfigError
from common.protocol.base import MAX_INDICES
from common.protocol.wire import WIRE_DTYPES

MODES = ("weighted-sync", "equal-sync", "async")
PLANNERS = ("model", "compute", "speed")
STALENESS = ("inverse", "poly", "hinge", "exp", "constant")
OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "cosine", "step")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def need_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ``ConfigError`` unless ``value`` of the option ``option`` is one of ``choices``."""
    need(value in choices, f"{option} {value!r} is not one of {', '.join(choices)}")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What a parameter server and a DDP run must share to be comparable; ``pserver start``'s
    own training settings and defaults.

    Attributes:
        global_batch: B, samples per update (split over workers or ranks).
        optimizer: ``sgd`` or ``adam``.
        lr, momentum, nesterov, weight_decay: optimizer settings.
        lr_schedule, warmup_fraction: the schedule of ``pserver.store.optimizer.lr_factor``.
        epochs, max_steps, target_oa: when training stops (at least one must be set).
        seed: model initialisation and epoch permutations.
    """

    global_batch: int = 64
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    lr_schedule: str = "constant"
    warmup_fraction: float = 0.0
    epochs: int | None = None
    max_steps: int | None = None
    target_oa: float | None = None
    seed: int = 0

    def validate(self) -> TrainSettings:
        """Check the training settings (the rules of ``pserver start`` and the DDP baseline).

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        global_batch, optimizer, lr = self.global_batch, self.optimizer, self.lr
        momentum, nesterov = self.momentum, self.nesterov
        weight_decay, lr_schedule = self.weight_decay, self.lr_schedule
        warmup_fraction, epochs = self.warmup_fraction, self.epochs
        max_steps, target_oa = self.max_steps, self.target_oa
        need(global_batch >= 1, f"--global-batch must be >= 1, got {global_batch}")
        need(
            global_batch <= MAX_INDICES,
            f"--global-batch must be <= {MAX_INDICES}, got {global_batch}",
        )
        need_choice("--optimizer", optimizer, OPTIMIZERS)
        need(math.isfinite(lr) and lr > 0, f"--lr must be > 0, got {lr}")
        need(0 <= momentum < 1, f"--momentum must be in [0, 1), got {momentum}")
        need(not nesterov or momentum > 0, "--nesterov needs --momentum > 0")
        need(
            math.isfinite(weight_decay) and weight_decay >= 0,
            f"--weight-decay must be >= 0, got {weight_decay}",
        )
        need_choice("--lr-schedule", lr_schedule, SCHEDULES)
        need(
            0 <= warmup_fraction < 1, f"--warmup-fraction must be in [0, 1), got {warmup_fraction}"
        )
        need(epochs is None or epochs >= 1, f"--epochs must be >= 1, got {epochs}")
        need(max_steps is None or max_steps >= 1, f"--max-steps must be >= 1, got {max_steps}")
        need(
            target_oa is None or 0 < target_oa <= 1,
            f"--target-oa must be in (0, 1], got {target_oa}",
        )
        need(
            epochs is not None or max_steps is not None or target_oa is not None,
            "give at least one of --epochs, --max-steps or --target-oa, or training never ends",
        )
        need(
            lr_schedule == "constant" or epochs is not None or max_steps is not None,
            f"--lr-schedule {lr_schedule} needs --epochs or --max-steps",
        )
        return self

    def server_args(self) -> tuple[str, ...]:
        """The training settings as ``pserver start`` options."""
        args: list[str] = []
        for field in dataclasses.fields(TrainSettings):
            value = getattr(self, field.name)
            if field.name == "nesterov":
                args.append("--nesterov" if value else "--no-nesterov")
            elif value is not None:
                args += ["--" + field.name.replace("_", "-"), str(value)]
        return tuple(args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig(TrainSettings):
    """Everything ``pserver start`` needs; checked on construction (errors quote the value)."""

    dataset: Path
    model: str
    mode: str = "weighted-sync"
    planner: str = "model"
    plan_spread: bool = True
    min_local_batch: int | None = None
    bind: str = "tcp://127.0.0.1:5555"
    workers: int = 1
    staleness: str = "inverse"
    staleness_a: float = 0.5
    staleness_b: float = 4.0
    max_staleness: int | None = None
    run_dir: Path | None = None
    overwrite: bool = False
    cache_mb: int = 2048
    eval_batch: int = 512
    eval_every: int = 1
    eval_every_updates: int | None = None
    eval_samples: int | None = None
    shutdown_timeout_s: float = 120.0
    write_timeout_s: float = 60.0
    torch_threads: int = 1
    heartbeat_s: float = 1.0
    checkpoint_every: int | None = None
    keep_best: bool = True
    snapshot_every_updates: int | None = None
    snapshot_limit: int = 1000
    curve_secret: Path | None = None
    authorized_keys: Path | None = None
    resume: bool = False
    dead_after_s: float = 5.0
    shards: int = 1
    shard_secret_file: Path | None = None
    wire_dtype: str = "fp32"
    chunk_mb: float = 4.0
    max_grad_norm: float | None = None
    outlier_factor: float = 1000.0
    stage_timeout_s: float = 120.0
    shard_timeout_s: float = 30.0
    max_workers: int = 256
    http_port: int | None = None
    http_bind: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> ServerConfig:
        """Check every field (also run on construction).

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        need_choice("--mode", self.mode, MODES)
        need_choice("--planner", self.planner, PLANNERS)
        need_choice("--staleness", self.staleness, STALENESS)
        super().validate()
        need(
            self.min_local_batch is None or self.min_local_batch >= 1,
            f"--min-local-batch must be >= 1, got {self.min_local_batch}",
        )
        need(
            self.min_local_batch is None or self.min_local_batch <= self.global_batch,
            f"--min-local-batch {self.min_local_batch} exceeds --global-batch {self.global_batch}",
        )
        need(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        need(
            self.workers <= self.max_workers,
            f"--workers {self.workers} exceeds --max-workers {self.max_workers}",
        )
        need(
            self.max_staleness is None or self.max_staleness >= 0,
            f"--max-staleness must be >= 0, got {self.max_staleness}",
        )
        need(self.staleness_a > 0, f"--staleness-a must be > 0, got {self.staleness_a}")
        need(self.staleness_b >= 0, f"--staleness-b must be >= 0, got {self.staleness_b}")
        for name in (
            "checkpoint_every",
            "eval_every_updates",
            "eval_samples",
            "snapshot_every_updates",
        ):
            value = getattr(self, name)
            need(value is None or value >= 1, f"--{flag(name)} must be >= 1, got {value}")
        need(
            self.run_dir is not None or not (self.resume or self.checkpoint_every),
            "--resume and --checkpoint-every need --run-dir",
        )
        need(
            self.run_dir is not None or self.snapshot_every_updates is None,
            "--snapshot-every-updates needs --run-dir",
        )
        need(self.snapshot_limit >= 2, f"--snapshot-limit must be >= 2, got {self.snapshot_limit}")
        need(not (self.resume and self.overwrite), "--resume and --overwrite exclude each other")
        need(
            (self.curve_secret is None) == (self.authorized_keys is None),
            "--curve-secret and --authorized-keys go together",
        )
        need(
            self.authorized_keys is None or self.authorized_keys.is_dir(),
            f"--authorized-keys {str(self.authorized_keys)!r} is not a directory",
        )
        need(self.heartbeat_s > 0, f"--heartbeat must be > 0, got {self.heartbeat_s}")
        need(
            self.dead_after_s > self.heartbeat_s,
            f"--dead-after ({self.dead_after_s}) must exceed --heartbeat ({self.heartbeat_s})",
        )
        need(self.torch_threads >= 1, f"--torch-threads must be >= 1, got {self.torch_threads}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.cache_mb >= 0, f"--cache-mb must be >= 0, got {self.cache_mb}")
        for name in ("shutdown_timeout_s", "write_timeout_s", "stage_timeout_s", "shard_timeout_s"):
            value = getattr(self, name)
            need(value > 0, f"--{flag(name)} must be > 0, got {value}")
        need(
            self.bind.startswith(ENDPOINT_SCHEMES),
            f"--bind {self.bind!r} must look like tcp://HOST:PORT",
        )
        need(1 <= self.shards <= 256, f"--shards must be in [1, 256], got {self.shards}")
        need(
            self.shards == 1 or self.shard_secret_file is not None or self.curve_secret is not None,
            f"--shards {self.shards} needs a secret the shards prove: --shard-secret-file FILE "
            "(the same file as each 'pserver shard --secret-file'; make one with "
            "'head -c 32 /dev/urandom > FILE') or CURVE keys",
        )
        need_choice("--wire-dtype", self.wire_dtype, WIRE_DTYPES)
        need(
            0.01 <= self.chunk_mb <= 256, f"--chunk-mb must be in [0.01, 256], got {self.chunk_mb}"
        )
        need(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            f"--max-grad-norm must be > 0, got {self.max_grad_norm}",
        )
        need(self.outlier_factor > 1, f"--outlier-factor must be > 1, got {self.outlier_factor}")
        need(self.max_workers >= 1, f"--max-workers must be >= 1, got {self.max_workers}")
        need(
            self.http_port is None or 0 <= self.http_port <= 65535,
            f"--http must be a port in 0..65535, got {self.http_port}",
        )
        need(_is_ip(self.http_bind), f"--http-bind {self.http_bind!r} is not an IP address")
        return self

    @property
    def is_sync(self) -> bool:
        """True for the two synchronous modes."""
        return self.mode != "async"

    @property
    def chunk_bytes(self) -> int:
        """Target bytes per wire chunk."""
        return int(self.chunk_mb * (1 << 20))


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """Everything ``pserver shard`` needs; checked on construction."""

    coordinator: str
    bind: str = "tcp://0.0.0.0:0"
    advertise: str | None = None
    name: str = dataclasses.field(default_factory=socket.gethostname)
    connect_timeout_s: float = 60.0
    curve_secret: Path | None = None
    authorized_keys: Path | None = None
    secret_file: Path | None = None
    torch_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("coordinator", "bind", "advertise"):  # --advertise may be left out
            value = getattr(self, name)
            need(
                value is None or value.startswith(ENDPOINT_SCHEMES),
                f"--{name} {value!r} must look like tcp://HOST:PORT",
            )
        need(
            self.connect_timeout_s > 0,
            f"--connect-timeout must be > 0, got {self.connect_timeout_s}",
        )
        need(
            (self.curve_secret is None) == (self.authorized_keys is None),
            "--curve-secret and --authorized-keys go together",
        )
        need(
            self.secret_file is not None or self.curve_secret is not None,
            "a shard needs the secret it proves to the coordinator: --secret-file FILE (the "
            "coordinator's --shard-secret-file) or CURVE keys",
        )
        need(self.torch_threads >= 1, f"--torch-threads must be >= 1, got {self.torch_threads}")


def advertised(bound: str, advertise: str | None) -> str:
    """The address workers and the coordinator use to reach a shard bound at ``bound``.

    Raises:
        ConfigError: bound to all interfaces without ``--advertise``.
    """
    if advertise is not None:
        if advertise.endswith((":0", ":*")):
            port = bound.rsplit(":", 1)[1]
            return advertise.rsplit(":", 1)[0] + ":" + port
        return advertise
    host = bound[len("tcp://") :].rsplit(":", 1)[0] if bound.startswith("tcp://") else ""
    if host in ("0.0.0.0", "*", "[::]", "::"):
        raise ConfigError(
            f"bound to all interfaces ({bound}): give --advertise tcp://THIS_HOST:PORT (port 0 "
            "takes the bound port) so workers know where to reach this shard"
        )
    return bound


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
