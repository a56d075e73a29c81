"""The server's validated configuration."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path

from common.errors import ConfigError

MODES = ("weighted-sync", "equal-sync", "async")
STALENESS = ("inverse", "poly", "hinge", "exp", "constant")
OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "cosine", "step")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything ``pserver start`` needs; ``validate()`` quotes any bad value."""

    dataset: Path
    model: str
    mode: str = "weighted-sync"
    bind: str = "tcp://127.0.0.1:5555"
    workers: int = 1
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
    staleness: str = "inverse"
    staleness_a: float = 0.5
    staleness_b: float = 4.0
    max_staleness: int | None = None
    run_dir: Path | None = None
    seed: int = 0
    cache_mb: int = 2048
    eval_batch: int = 512
    eval_every: int = 1
    shutdown_timeout_s: float = 10.0
    data_threads: int = 2
    torch_threads: int = 1
    heartbeat_s: float = 1.0
    checkpoint_every: int | None = None
    curve_secret: Path | None = None
    authorized_keys: Path | None = None
    resume: bool = False
    dead_after_s: float = 5.0
    http_port: int | None = None
    http_bind: str = "127.0.0.1"

    def validate(self) -> ServerConfig:
        """Check every field.

        Returns:
            ``self``, so that ``ServerConfig(...).validate()`` reads naturally.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(what)

        need(self.mode in MODES, f"--mode {self.mode!r} is not one of {', '.join(MODES)}")
        need(
            self.staleness in STALENESS,
            f"--staleness {self.staleness!r} is not one of {', '.join(STALENESS)}",
        )
        need(
            self.optimizer in OPTIMIZERS,
            f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}",
        )
        need(
            self.lr_schedule in SCHEDULES,
            f"--lr-schedule {self.lr_schedule!r} is not one of {', '.join(SCHEDULES)}",
        )
        need(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        need(self.global_batch >= 1, f"--global-batch must be >= 1, got {self.global_batch}")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        need(
            0 <= self.warmup_fraction < 1,
            f"--warmup-fraction must be in [0, 1), got {self.warmup_fraction}",
        )
        need(self.epochs is None or self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        need(
            self.max_steps is None or self.max_steps >= 1,
            f"--max-steps must be >= 1, got {self.max_steps}",
        )
        need(
            self.target_oa is None or 0 < self.target_oa <= 1,
            f"--target-oa must be in (0, 1], got {self.target_oa}",
        )
        need(
            self.epochs is not None or self.max_steps is not None or self.target_oa is not None,
            "give at least one of --epochs, --max-steps or --target-oa, or training never ends",
        )
        need(
            self.lr_schedule == "constant" or self.epochs is not None or self.max_steps is not None,
            f"--lr-schedule {self.lr_schedule} needs --epochs or --max-steps",
        )
        need(
            self.max_staleness is None or self.max_staleness >= 0,
            f"--max-staleness must be >= 0, got {self.max_staleness}",
        )
        need(self.staleness_a > 0, f"--staleness-a must be > 0, got {self.staleness_a}")
        need(self.staleness_b >= 0, f"--staleness-b must be >= 0, got {self.staleness_b}")
        need(
            self.checkpoint_every is None or self.checkpoint_every >= 1,
            f"--checkpoint-every must be >= 1, got {self.checkpoint_every}",
        )
        need(
            self.run_dir is not None or not (self.resume or self.checkpoint_every),
            "--resume and --checkpoint-every need --run-dir",
        )
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
        need(self.eval_every >= 1, f"--eval-every must be >= 1, got {self.eval_every}")
        need(self.cache_mb >= 0, f"--cache-mb must be >= 0, got {self.cache_mb}")
        need(
            self.shutdown_timeout_s > 0,
            f"--shutdown-timeout must be > 0, got {self.shutdown_timeout_s}",
        )
        need(
            self.bind.startswith(("tcp://", "ipc://", "inproc://")),
            f"--bind {self.bind!r} must look like tcp://HOST:PORT",
        )
        need(self.dataset.exists(), f"--dataset {str(self.dataset)!r} does not exist")
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


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
