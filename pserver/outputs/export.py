"""``pserver export``: a run's checkpoint as a self-contained model file (torch.export or weights).

Findings that decided the format (torch 2.13.0, checked when this was written):
``torch.jit.script``, ``torch.jit.trace``, ``torch.jit.save`` and ``torch.jit.load`` each
raise a DeprecationWarning ("Please switch to torch.compile or torch.export"), so a
TorchScript file could not be loaded without a warning and TorchScript is not offered.
``torch.export.export`` / ``torch.export.save`` / ``torch.export.load`` raise none, and
``torch.export.save`` stores extra files beside the program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common.data.dataset import DatasetReader
from common.errors import ConfigError, DatasetError, ModelError
from common.safefile import write_atomic
from common.training.flat import FlatLayout
from common.training.models import build_model, check_allowed
from pserver.history import read_history

log = logging.getLogger(__name__)

FORMATS = ("program", "state-dict")
META_FILE = "meta.json"
MAGIC = "rs-pserver-model"
META_VERSION = 1


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Hide torch's deprecation and future warnings from users of the export commands."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning, UserWarning):
            warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")
        yield


class RawInput(nn.Module):
    """A classifier that takes raw samples: the per-band normalisation of training, then the
    network.

    Args:
        network: the trained model, taking normalised (N, C, H, W) input.
        mean: per-band mean (C,) subtracted during training.
        std: per-band std (C,) divided by during training.
    """

    def __init__(self, network: nn.Module, mean: np.ndarray, *, std: np.ndarray) -> None:
        super().__init__()
        self.network = network
        shape = (1, -1, 1, 1)
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).reshape(shape))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map raw float32 (N, C, H, W) samples to (N, K) class logits."""
        mean, std = self.mean, self.std
        assert isinstance(mean, torch.Tensor) and isinstance(std, torch.Tensor)
        return self.network((x - mean) / std)


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What ``pserver export`` writes.

    Attributes:
        run_dir: the run directory (``checkpoints/``, ``summary.json``, ``metrics.jsonl``).
        out: the model file to write.
        checkpoint: the checkpoint to export (default: the newest in ``run_dir/checkpoints``).
        dataset: the run's dataset file (default: the one named in the run's summary or log).
        format: ``program`` (torch.export, loads with ``torch.export.load``) or ``state-dict``
            (``torch.load(weights_only=True)``, for users who rebuild the model themselves).
        allow_model: user models (``package.module:factory``) the run's files may name; any
            other is refused, since building it imports its module.
    """

    run_dir: Path
    out: Path
    checkpoint: Path | None = None
    dataset: Path | None = None
    format: str = "program"
    allow_model: tuple[str, ...] = ()

    def validate(self) -> ExportConfig:
        """Check the paths and the format.

        Raises:
            ConfigError: a value is invalid; the message quotes it.
        """
        if self.format not in FORMATS:
            raise ConfigError(f"format must be one of {FORMATS}, got {self.format!r}")
        if not self.run_dir.is_dir():
            raise ConfigError(f"run directory {str(self.run_dir)!r} does not exist")
        comparison_runs(self.run_dir)
        if not self.out.parent.is_dir():
            raise ConfigError(f"output folder {str(self.out.parent)!r} does not exist")
        return self


def comparison_runs(folder: Path) -> None:
    """Refuse a ``pslaunch compare`` folder, naming the run folders it holds.

    Raises:
        ConfigError: ``folder`` holds ``compare.json`` but no run of its own.
    """
    if not (folder / "compare.json").is_file() or (folder / "summary.json").is_file():
        return
    runs = sorted(p.name for p in (folder / "runs").glob("*-*") if p.is_dir())
    shown = ", ".join(f"runs/{name}" for name in runs[:8]) + (", ..." if len(runs) > 8 else "")
    raise ConfigError(
        f"{str(folder)!r} is a comparison folder; export one of its runs: "
        f"pserver export {folder / 'runs' / (runs[0] if runs else '<mode>-<repeat>')} ... "
        f"(runs: {shown or 'none yet'})"
    )


def _run_record(run_dir: Path) -> dict[str, Any]:
    """The run's summary, or its last ``start`` event when it has no summary (yet)."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        return {"summary": json.loads(summary.read_text(encoding="utf-8")), "start": None}
    metrics = run_dir / "metrics.jsonl"
    events = read_history(metrics) if metrics.is_file() else []
    starts = [event for _, event in events if event["event"] == "start"]
    return {"summary": None, "start": starts[-1] if starts else None}


def _checkpoint(config: ExportConfig) -> tuple[Path, np.ndarray, dict[str, Any]]:
    """The checkpoint file, its flat state and its meta."""
    from pserver import checkpoint

    path = config.checkpoint or checkpoint.latest(config.run_dir / "checkpoints")
    if path is None:
        raise ConfigError(
            f"no checkpoint in {str(config.run_dir / 'checkpoints')!r}: runs write one when "
            "training ends if --run-dir is given; or pass --checkpoint FILE"
        )
    if not Path(path).is_file():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    ckpt = checkpoint.read(Path(path))
    if "state" not in ckpt.arrays:
        raise ConfigError(f"checkpoint {str(path)!r} holds no 'state' array")
    state = np.asarray(ckpt.arrays["state"], dtype=np.float32)
    if not np.isfinite(state).all():
        raise ConfigError(f"checkpoint {str(path)!r} holds parameters that are not finite")
    return Path(path), state, ckpt.meta


def _describe(
    config: ExportConfig, reader: DatasetReader, name: str, ckpt: tuple[Path, dict[str, Any]]
) -> dict[str, Any]:
    """The metadata stored with the model."""
    meta = reader.meta
    channels, height, width = meta.shape
    path, ckpt_meta = ckpt
    record = _run_record(config.run_dir)
    return {
        "format": MAGIC,
        "format_version": META_VERSION,
        "export": config.format,
        "model": name,
        "kind": meta.kind,
        "bands": channels,
        "height": height,
        "width": width,
        "patch": int(meta.attrs.get("patch", height)) if meta.kind == "hsi" else None,
        "resize": meta.attrs.get("size"),
        "class_names": list(meta.class_names),
        "num_classes": meta.num_classes,
        "input": "float32 (N, bands, height, width), raw values as in the source data",
        "output": "float32 (N, num_classes) class logits",
        "norm_mean": np.asarray(reader.norm_mean, dtype=np.float64).tolist(),
        "norm_std": np.asarray(reader.norm_std, dtype=np.float64).tolist(),
        "dataset": {
            "path": str(meta.path),
            "fingerprint": meta.fingerprint,
            "source": meta.source,
            "train": meta.train_count,
            "test": meta.test_count,
        },
        "checkpoint": {"path": str(path), "version": ckpt_meta.get("version")},
        "torch": str(torch.__version__),
        "summary": record["summary"],
    }


def _dataset_path(config: ExportConfig, record: dict[str, Any]) -> Path:
    if config.dataset is not None:
        return config.dataset
    source = record["summary"] or record["start"] or {}
    if not source.get("dataset"):
        raise ConfigError(
            f"{str(config.run_dir)!r} names no dataset (no summary.json or start event); "
            "pass --dataset DATA.h5"
        )
    path = Path(source["dataset"])
    if not path.is_file():
        raise ConfigError(
            f"the run's dataset {str(path)!r} is not found from here; pass --dataset DATA.h5"
        )
    return path


def build_classifier(config: ExportConfig) -> tuple[RawInput, dict[str, Any]]:
    """Rebuild the run's model from a checkpoint, with the normalisation in front.

    Args:
        config: the validated export configuration.

    Returns:
        ``(module in eval mode, metadata)``.

    Raises:
        ConfigError: no checkpoint, no dataset, or they do not belong together.
        DatasetError: the dataset file is invalid or lacks normalisation statistics.
        ModelError: the model cannot be built, or is a user model not in ``allow_model``.
    """
    ckpt_path, state, ckpt_meta = _checkpoint(config)
    record = _run_record(config.run_dir)
    name = (record["summary"] or {}).get("model") or ckpt_meta.get("model")
    if not name:
        raise ConfigError(f"cannot tell the model of run {str(config.run_dir)!r}")
    check_allowed(name, config.allow_model, f"run {str(config.run_dir)!r}")
    with DatasetReader(_dataset_path(config, record), cache_bytes=0) as reader:
        meta = reader.meta
        trained_on = ckpt_meta.get("fingerprint")
        if trained_on is not None and trained_on != meta.fingerprint:
            raise ConfigError(
                f"dataset {meta.path!r} (fingerprint {meta.fingerprint[:12]}) is not the one "
                f"checkpoint {str(ckpt_path)!r} was trained on ({str(trained_on)[:12]})"
            )
        if reader.norm_mean is None or reader.norm_std is None:
            raise DatasetError(f"dataset {meta.path!r} has no normalisation statistics")
        description = _describe(config, reader, name, (ckpt_path, ckpt_meta))
        mean, std = reader.norm_mean, reader.norm_std
    channels, height, _ = meta.shape
    network = build_model(name, channels, meta.num_classes, height)
    try:
        FlatLayout(network).write_state(state)
    except ValueError as exc:
        raise ConfigError(
            f"checkpoint {str(ckpt_path)!r} does not fit model {name!r}: {exc}"
        ) from exc
    return RawInput(network, mean, std=std).eval(), description


def export(config: ExportConfig) -> dict[str, Any]:
    """Write the run's model to ``config.out``.

    ``program``: a ``torch.export`` program of ``RawInput`` with a dynamic batch size, saved
    with ``torch.export.save`` and the metadata as the extra file ``meta.json``; it loads with
    plain torch (``torch.export.load(path).module()``), without this project. ``state-dict``:
    ``{"format", "meta", "state_dict"}`` for ``torch.load(path, weights_only=True)``.

    Args:
        config: what to export.

    Returns:
        The metadata written with the model.

    Raises:
        ConfigError, DatasetError, ModelError: see ``build_classifier``; ModelError also when
            torch cannot export the model.
    """
    config.validate()
    module, meta = build_classifier(config)
    if config.format == "state-dict":
        state = {k: v.detach().clone() for k, v in module.network.state_dict().items()}
        document = {"format": MAGIC, "meta": meta, "state_dict": state}
        write_atomic(config.out, lambda handle: torch.save(document, handle))
    else:
        example = torch.zeros((2, meta["bands"], meta["height"], meta["width"]))
        batch = torch.export.Dim("batch", min=1)
        with quiet_torch(), torch.no_grad():
            try:
                program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
            except Exception as exc:  # torch raises many internal types here
                raise ModelError(f"torch.export failed on model {meta['model']!r}: {exc}") from exc
            # A file object, not a path: torch warns about paths not ending in .pt2.
            extra = {META_FILE: json.dumps(meta)}
            write_atomic(
                config.out, lambda handle: torch.export.save(program, handle, extra_files=extra)
            )
    log.info("exported %s (%s) to %s", meta["model"], config.format, config.out)
    return meta
