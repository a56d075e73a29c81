"""What the multi-host bench runs: its validated config and the declarative PS variants.

A variant is a few lines: a name, extra ``pserver start`` options, where shard servers go and
whether workers read a local copy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.data.convert.synth import synth_hsi, synth_scenes
from common.errors import ConfigError
from launch.cluster.spec import rate_bits


@dataclasses.dataclass(frozen=True)
class Variant:
    """One parameter-server configuration to measure.

    Attributes:
        name: the row label.
        options: extra ``pserver start`` options; ``{shards}`` becomes the shard count.
        shards: ``""`` (no shard servers), ``"workers"`` (one ``pserver shard`` per worker
            host) or ``"fast"`` (one per worker host whose link is the fastest, so none on a
            slow host).
        local_data: workers read the dataset's local copy (``worker join --data``) instead of
            pulling samples from the server over the capped links.
    """

    name: str
    options: tuple[str, ...] = ()
    shards: str = ""
    local_data: bool = False

    def shard_hosts(self, rates: tuple[str, ...]) -> list[int]:
        """Indices of the worker hosts (1..N) that run a shard server, given every host's rate."""
        workers = range(1, len(rates))
        if self.shards == "workers":
            return list(workers)
        if self.shards == "fast":
            fastest = max(rate_bits(rates[i]) for i in workers)
            return [i for i in workers if rate_bits(rates[i]) == fastest]
        return []

    def server_options(self, rates: tuple[str, ...]) -> list[str]:
        """``options`` with ``{shards}`` filled in."""
        count = str(len(self.shard_hosts(rates)))
        return [opt.replace("{shards}", count) for opt in self.options]


MODES = ("weighted-sync", "equal-sync")
SHARDS = ("--shards", "{shards}")
VARIANTS = (  # what each is for: docs/benchmarks.md, "Multi-host benches"
    Variant("ps-k1"),
    Variant("ps-k1-local", local_data=True),
    Variant("ps-k1-bf16", ("--wire-dtype", "bf16"), local_data=True),
    Variant("ps-kN", (*SHARDS, "--wire-dtype", "fp32"), "workers", local_data=True),
    Variant("ps-kN-pull", (*SHARDS, "--wire-dtype", "fp32"), "workers"),
    Variant("ps-kN-bf16", (*SHARDS, "--wire-dtype", "bf16"), "workers", local_data=True),
    Variant("ps-kfast", SHARDS, "fast", local_data=True),
    Variant("ps-k1-compute-plan", ("--planner", "compute"), local_data=True),
    Variant("ps-k1-transfer-plan", ("--planner", "model"), local_data=True),
    Variant("ps-kfast-transfer-plan", (*SHARDS, "--planner", "model"), "fast", local_data=True),
)
DEFAULT_VARIANTS = ("ps-k1", "ps-k1-local", "ps-k1-bf16", "ps-kN", "ps-kN-pull", "ps-kN-bf16")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The multi-host bench's settings: one field per option of ``python -m bench multihost``
    (its ``--help`` says what each is), ``rates`` one per host, server first, and ``variants``
    names from ``VARIANTS``.
    """

    workers: int = 3
    rates: tuple[str, ...] = ("1gbit",) * 4
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    model: str = "resnet18"
    size: int = 32
    samples: int = 2000
    batch: int = 8
    steps: int = 12
    warmup: int = 2
    repeats: int = 3
    threads: int = 1
    probe_mb: float = 0.0
    compute_s: float = 0.0
    job_timeout: float = 900.0
    out: Path = Path("runs/multihost")
    prefix: str = "mh"
    mode: str = "weighted-sync"
    small_batch: int = 1

    def validate(self) -> BenchConfig:
        """Check every field.

        Returns:
            The config itself.

        Raises:
            ConfigError: quoting the bad value.
        """
        if not 1 <= self.workers <= 16:
            raise ConfigError(f"--workers must be in [1, 16], got {self.workers}")
        if len(self.rates) != self.workers + 1:
            raise ConfigError(
                f"--rates needs {self.workers + 1} rates (server, then each worker), "
                f"got {len(self.rates)}: {','.join(self.rates)}"
            )
        for rate in self.rates:
            rate_bits(rate)
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        known = {v.name for v in VARIANTS}
        unknown = [name for name in self.variants if name not in known]
        if unknown:
            raise ConfigError(f"unknown variants {unknown}; known: {sorted(known)}")
        for name, value, low in (
            ("--size", self.size, 8),
            ("--batch", self.batch, 1),
            ("--steps", self.steps, 1),
            ("--repeats", self.repeats, 1),
            ("--threads", self.threads, 1),
            ("--small-batch", self.small_batch, 0),
        ):
            if value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}")
        if self.warmup < 0 or self.warmup >= self.steps:
            raise ConfigError(f"--warmup must be in [0, --steps), got {self.warmup}")
        if self.samples < 2 * self.batch * self.workers * (self.steps + 1):
            raise ConfigError(
                f"--samples {self.samples} is too few for {self.steps} steps of "
                f"{self.batch * self.workers} without an epoch end (evaluation) in a run"
            )
        if self.job_timeout < 60:
            raise ConfigError(f"--job-timeout must be >= 60 s, got {self.job_timeout}")
        if self.compute_s < 0:
            raise ConfigError(f"--compute-s must be >= 0, got {self.compute_s}")
        if self.probe_mb < 0:
            raise ConfigError(f"--probe-mb must be >= 0, got {self.probe_mb}")
        return self

    def variant(self, name: str) -> Variant:
        """The ``Variant`` called ``name``."""
        return next(v for v in VARIANTS if v.name == name)


def scenes_dataset(out: Path, samples: int, size: int) -> Path:
    """Synthetic 3-band, 10-class scenes (as ``pserver data synth --kind scenes`` writes them),
    made once per (samples, size) in ``out``."""
    path = out / f"scenes-{size}px-{samples}.h5"
    if not path.exists():
        synth_scenes(path, samples=samples, bands=3, size=size, classes=10, seed=0)
    return path


def hsi_dataset(out: Path, size: int, patch: int) -> Path:
    """``patch`` x ``patch`` patches of every labelled pixel of a synthetic 32-band, 6-class
    hyperspectral scene of side ``size`` (half of each class for training, as ``pserver data
    synth --kind hsi`` writes them), made once per (size, patch) in ``out``."""
    path = out / f"hsi-{size}px-p{patch}.h5"
    if not path.exists():
        synth_hsi(path, bands=32, size=size, classes=6, patch=patch, train_fraction=0.5, seed=0)
    return path
