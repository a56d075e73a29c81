"""Loading a model file written by ``pserver export`` and running it on raw samples."""

from __future__ import annotations

import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common.errors import ModelError
from pserver.outputs.export import MAGIC, RawInput, quiet_torch
from pserver.outputs.program_weights import first_line, read_program

log = logging.getLogger(__name__)

MAX_SIZE = 1 << 16  # bands, patch sides and classes a model file may claim

_REQUIRED = (
    "kind",
    "bands",
    "height",
    "width",
    "class_names",
    "num_classes",
    "model",
    "norm_mean",
    "norm_std",
)


@dataclass
class LoadedModel:
    """An exported classifier ready to run.

    Attributes:
        path: the model file.
        meta: the metadata written by ``pserver export``.
        module: maps raw float32 (N, C, H, W) to (N, K) logits.
        device: where it runs.
    """

    path: Path
    meta: dict[str, Any]
    module: nn.Module
    device: torch.device

    @property
    def class_names(self) -> list[str]:
        """The class names, index k for logit k."""
        return list(self.meta["class_names"])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(bands, height, width) of one raw sample."""
        return int(self.meta["bands"]), int(self.meta["height"]), int(self.meta["width"])

    @torch.inference_mode()
    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        """Class probabilities of a batch of raw samples.

        Args:
            batch: float32 (N, C, H, W) raw values (as in the source data).

        Returns:
            float32 (N, K) softmax probabilities.
        """
        x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).to(self.device)
        return torch.softmax(self.module(x), dim=1).float().cpu().numpy()

    @torch.inference_mode()
    def classify(self, batch: np.ndarray) -> np.ndarray:
        """The predicted class index (int64, (N,)) of each raw sample of a float32 batch."""
        x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).to(self.device)
        return self.module(x).argmax(dim=1).cpu().numpy()


def _check_meta(path: Path, meta: Any) -> dict[str, Any]:
    try:
        json.dumps(meta)  # the encoder refuses nesting deeper than the recursion limit
    except (RecursionError, TypeError, ValueError) as exc:
        raise ModelError(f"model metadata of {str(path)!r}: {first_line(exc)}") from None
    if not isinstance(meta, dict) or meta.get("format") != MAGIC:
        raise ModelError(f"{str(path)!r} was not written by 'pserver export' (no model metadata)")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ModelError(f"model metadata of {str(path)!r} lacks {missing}")
    sizes = [meta[k] for k in ("bands", "height", "width", "num_classes")]
    if not all(type(v) is int and 1 <= v <= MAX_SIZE for v in sizes):
        raise ModelError(f"model metadata of {str(path)!r} has absurd sizes {sizes}")
    for key in ("norm_mean", "norm_std"):
        values = meta[key]
        if not isinstance(values, list) or len(values) != meta["bands"]:
            raise ModelError(f"model metadata of {str(path)!r}: {key} does not fit its bands")
        if not all(type(v) in (int, float) and np.isfinite(v) for v in values):
            raise ModelError(f"model metadata of {str(path)!r}: {key} is not finite")
    if not isinstance(meta["model"], str):
        raise ModelError(f"model metadata of {str(path)!r} names no model")
    return meta


def _build(path: Path, meta: dict[str, Any], allow_model: tuple[str, ...]) -> RawInput:
    """The model ``meta`` names (built in, or allowed), with its normalisation in front."""
    from common.training.models import build_model, check_allowed

    check_allowed(meta["model"], allow_model, f"model file {str(path)!r}")
    network = build_model(meta["model"], meta["bands"], meta["num_classes"], meta["height"])
    return RawInput(network, np.asarray(meta["norm_mean"]), std=np.asarray(meta["norm_std"]))


def _load_program(
    path: Path, allow_model: tuple[str, ...]
) -> tuple[dict[str, Any], nn.Module, dict[str, torch.Tensor]]:
    built: list[tuple[dict[str, Any], nn.Module]] = []

    def shapes(meta: Any) -> dict[str, tuple[int, ...]]:
        meta = _check_meta(path, meta)
        built.append((meta, _build(path, meta, allow_model)))
        return {k: tuple(v.shape) for k, v in built[0][1].state_dict().items()}

    _, weights = read_program(path, shapes)
    return *built[0], weights


def _load_state_dict(
    path: Path, allow_model: tuple[str, ...]
) -> tuple[dict[str, Any], nn.Module, dict[str, torch.Tensor]]:
    try:
        with quiet_torch():
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch/pickle raise many types for foreign files
        raise ModelError(
            f"{str(path)!r} is not a model file written by 'pserver export': {first_line(exc)}"
        ) from exc
    meta = _check_meta(path, saved.get("meta") if isinstance(saved, dict) else None)
    state = saved.get("state_dict")
    if not isinstance(state, dict):
        raise ModelError(f"{str(path)!r} holds no weights")
    module = _build(path, meta, allow_model)
    network = {f"network.{k}": v for k, v in state.items()}
    return meta, module, {"mean": module.mean, "std": module.std, **network}


def load_model(
    path: str | Path, device: torch.device | None = None, allow_model: tuple[str, ...] = ()
) -> LoadedModel:
    """Load a file written by ``pserver export`` (either format) without running code it holds.

    Nothing in the file is unpickled or executed: a ``program`` file's weights are read as
    raw tensors (``program_weights``), a ``state-dict`` file with
    ``torch.load(weights_only=True)``; the model is then rebuilt by the name in its metadata,
    a built-in one, or a user model only if it is in ``allow_model`` (building it imports
    its module).

    Args:
        path: the model file.
        device: where to run it (default CPU).
        allow_model: user models (``package.module:factory``) the file may name.

    Returns:
        The loaded model.

    Raises:
        ModelError: the file is missing, is a training checkpoint or not a model written by
            ``pserver export``, holds something that is never loaded (pickled objects,
            compiled code) or that is malformed (see ``read_program``), or names a user model
            that is not allowed.
    """
    path = Path(path)
    device = device or torch.device("cpu")
    if not path.is_file():
        raise ModelError(f"model file {str(path)!r} does not exist")
    if not zipfile.is_zipfile(path):
        raise ModelError(f"{str(path)!r} is not a model file written by 'pserver export'")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelError(
            f"{str(path)!r} is not a readable zip archive: {first_line(exc)}"
        ) from None
    if names and all(name.endswith(".npy") for name in names):
        raise ModelError(
            f"{str(path)!r} is a training checkpoint (or another .npz), not a model file: make "
            "one with 'pserver export RUN_DIR --out model.pt' (--checkpoint FILE exports this "
            "checkpoint), then predict with that"
        )
    if not any("/" in name for name in names):  # torch keeps every entry in a folder
        raise ModelError(f"{str(path)!r} is not a model file written by 'pserver export'")
    program = any(name.endswith("archive_format") for name in names)
    meta, module, weights = (_load_program if program else _load_state_dict)(path, allow_model)
    try:
        module.load_state_dict(weights)
    except (KeyError, RuntimeError) as exc:
        raise ModelError(
            f"weights in {str(path)!r} do not fit {meta['model']!r}: {first_line(exc)}"
        ) from exc
    return LoadedModel(path=path, meta=meta, module=module.eval().to(device), device=device)
