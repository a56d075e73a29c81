"""Training hyperparameters shared by parameter-server runs and the DDP baseline."""

from __future__ import annotations

import dataclasses

from common.config import default
from pserver.config import ServerConfig, check_training


def server_mode_args(staleness: str | None, max_staleness: int | None) -> tuple[str, ...]:
    """``pserver start`` options for the async settings given (none for server defaults)."""
    args: list[str] = []
    if staleness is not None:
        args += ["--staleness", staleness]
    if max_staleness is not None:
        args += ["--max-staleness", str(max_staleness)]
    return tuple(args)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What a parameter server and a DDP run must share to be comparable.

    Defaults are ``pserver start``'s own defaults.

    Attributes:
        global_batch: B, samples per update (split over workers or ranks).
        optimizer: ``sgd`` or ``adam``.
        lr, momentum, nesterov, weight_decay: optimizer settings.
        lr_schedule, warmup_fraction: the schedule of ``pserver.store.optimizer.lr_factor``.
        epochs, max_steps, target_oa: when training stops (at least one must be set).
        seed: model initialisation and epoch permutations.
    """

    global_batch: int = default(ServerConfig, "global_batch")
    optimizer: str = default(ServerConfig, "optimizer")
    lr: float = default(ServerConfig, "lr")
    momentum: float = default(ServerConfig, "momentum")
    nesterov: bool = default(ServerConfig, "nesterov")
    weight_decay: float = default(ServerConfig, "weight_decay")
    lr_schedule: str = default(ServerConfig, "lr_schedule")
    warmup_fraction: float = default(ServerConfig, "warmup_fraction")
    epochs: int | None = None
    max_steps: int | None = None
    target_oa: float | None = None
    seed: int = default(ServerConfig, "seed")

    def validate(self) -> TrainSettings:
        """Check every field with the rules ``pserver start`` applies to the same options.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        check_training(self)
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
