"""Training hyperparameters shared by parameter-server runs and the DDP baseline."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.errors import ConfigError
from pserver.config import OPTIMIZERS, SCHEDULES, ServerConfig

_SERVER_DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(ServerConfig)
    if f.default is not dataclasses.MISSING
}


def server_default(name: str) -> Any:
    """The default of a ``pserver start`` option, so both sides of a comparison agree.

    Args:
        name: a ``ServerConfig`` field name, e.g. ``"lr"``.

    Returns:
        Its default value.
    """
    return _SERVER_DEFAULTS[name]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What a parameter server and a DDP run must share to be comparable.

    Defaults are ``pserver start``'s own defaults.

    Attributes:
        global_batch: B, samples per update (split over workers or ranks).
        optimizer: ``sgd`` or ``adam``.
        lr, momentum, nesterov, weight_decay: optimizer settings.
        lr_schedule, warmup_fraction: the schedule of ``pserver.optimizer.lr_factor``.
        epochs, max_steps, target_oa: when training stops (at least one must be set).
        seed: model initialisation and epoch permutations.
    """

    global_batch: int = server_default("global_batch")
    optimizer: str = server_default("optimizer")
    lr: float = server_default("lr")
    momentum: float = server_default("momentum")
    nesterov: bool = server_default("nesterov")
    weight_decay: float = server_default("weight_decay")
    lr_schedule: str = server_default("lr_schedule")
    warmup_fraction: float = server_default("warmup_fraction")
    epochs: int | None = None
    max_steps: int | None = None
    target_oa: float | None = None
    seed: int = server_default("seed")

    def validate(self) -> TrainSettings:
        """Check every field.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        checks = [
            (self.global_batch >= 1, f"--global-batch must be >= 1, got {self.global_batch}"),
            (
                self.optimizer in OPTIMIZERS,
                f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}",
            ),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}"),
            (
                not self.nesterov or self.momentum > 0,
                "--nesterov needs --momentum > 0",
            ),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (
                self.lr_schedule in SCHEDULES,
                f"--lr-schedule {self.lr_schedule!r} is not one of {', '.join(SCHEDULES)}",
            ),
            (
                0 <= self.warmup_fraction < 1,
                f"--warmup-fraction must be in [0, 1), got {self.warmup_fraction}",
            ),
            (self.epochs is None or self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (
                self.max_steps is None or self.max_steps >= 1,
                f"--max-steps must be >= 1, got {self.max_steps}",
            ),
            (
                self.target_oa is None or 0 < self.target_oa <= 1,
                f"--target-oa must be in (0, 1], got {self.target_oa}",
            ),
            (
                self.epochs is not None or self.max_steps is not None or self.target_oa is not None,
                "give at least one of --epochs, --max-steps or --target-oa, or training never ends",
            ),
            (
                self.lr_schedule == "constant"
                or self.epochs is not None
                or self.max_steps is not None,
                f"--lr-schedule {self.lr_schedule} needs --epochs or --max-steps",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    def server_args(self) -> tuple[str, ...]:
        """The same settings as ``pserver start`` options."""
        args: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if field.name == "nesterov":
                args.append("--nesterov" if value else "--no-nesterov")
            elif value is not None:
                args += [flag, str(value)]
        return tuple(args)

    def progress(self, steps: int, samples: int, train_count: int) -> float:
        """Fraction of training done, exactly as the server's trainer computes it.

        Args:
            steps: updates applied so far.
            samples: training samples applied so far.
            train_count: size of the training split.

        Returns:
            The progress in [0, 1] that drives the learning-rate schedule (0 without a limit).
        """
        if self.max_steps is not None:
            return steps / self.max_steps
        if self.epochs is not None:
            return samples / (self.epochs * train_count)
        return 0.0
