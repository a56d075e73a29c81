"""The worker's validated configuration, and the check that its server's host resolves."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from urllib.parse import urlsplit

from common.config import name_problem
from common.errors import ConfigError
from common.training.slowdown import SlowdownSchedule


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything ``worker join`` needs; checked on construction (errors quote the value)."""

    server: str
    device: str = "cpu"
    slowdown: float = 1.0
    slowdown_schedule: str = ""
    name: str = dataclasses.field(default_factory=socket.gethostname)
    threads: int = 1
    connect_timeout_s: float = 30.0
    reply_timeout_s: float = 600.0
    data_timeout_s: float = 120.0
    rejoin_timeout_s: float = 120.0
    calibration_batch: int = 32
    log_every: int = 50
    data: str | None = None
    augment: bool = False
    augment_noise: float = 0.0
    curve_server_key: str | None = None
    curve_secret: str | None = None
    allow_model: tuple[str, ...] = ()
    cache_mb: int = 512

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> WorkerConfig:
        """Check every field.

        Returns:
            ``self``.

        Raises:
            ConfigError: a value is out of range; the message quotes it.
        """
        if not self.server.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"--server {self.server!r} must look like tcp://HOST:PORT")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"--device {self.device!r} must be cpu or cuda:N")
        if self.slowdown < 1:
            raise ConfigError(f"--slowdown must be >= 1, got {self.slowdown}")
        SlowdownSchedule(self.slowdown, self.slowdown_schedule)  # raises on a malformed one
        if self.cache_mb < 0:
            raise ConfigError(f"--cache-mb must be >= 0, got {self.cache_mb}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if name_problem(self.name, "--name"):
            raise ConfigError(name_problem(self.name, "--name"))
        for field in (
            "connect_timeout_s",
            "reply_timeout_s",
            "data_timeout_s",
            "rejoin_timeout_s",
        ):
            if getattr(self, field) <= 0:
                raise ConfigError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.data is not None and not os.path.isfile(self.data):
            raise ConfigError(f"--data {self.data!r} is not a file")
        if (self.curve_server_key is None) != (self.curve_secret is None):
            raise ConfigError("--curve-server-key and --curve-secret go together")
        for model in self.allow_model:
            if ":" not in model:
                raise ConfigError(
                    f"--allow-model {model!r} must be package.module:factory (built-in models "
                    "need no permission)"
                )
        if not (math.isfinite(self.augment_noise) and self.augment_noise >= 0):
            raise ConfigError(f"--augment-noise must be >= 0, got {self.augment_noise}")
        if self.augment_noise > 0 and not self.augment:
            raise ConfigError(
                f"--augment-noise {self.augment_noise} has no effect without --augment"
            )
        return self


def check_server_host(endpoint: str) -> None:
    """Resolve the host of a ``tcp://HOST:PORT`` endpoint once, before connecting.

    ZeroMQ retries an unresolvable name silently until the connect timeout, so a typo in
    ``--server`` would cost the whole ``--connect-timeout``; this turns it into an error at once.
    Other transports (``ipc://``, ``inproc://``) are not checked.

    Args:
        endpoint: the ``--server`` value.

    Raises:
        ConfigError: the host name cannot be resolved.
    """
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.hostname == "*":
        return
    try:
        socket.getaddrinfo(parts.hostname, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"--server {endpoint!r}: host {parts.hostname!r} cannot be resolved ({exc}); "
            "check the name, or give the server's IP address"
        ) from None
