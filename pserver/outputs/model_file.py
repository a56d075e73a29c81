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
from pserver.outputs.export import MAGIC, META_FILE, RawInput, quiet_torch

log = logging.getLogger(__name__)

_REQUIRED = ("kind", "bands", "height", "width", "class_names", "num_classes", "model")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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
    if not isinstance(meta, dict) or meta.get("format") != MAGIC:
        raise ModelError(f"{str(path)!r} was not written by 'pserver export' (no model metadata)")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ModelError(f"model metadata of {str(path)!r} lacks {missing}")
    return meta


def _load_program(path: Path, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    extra = {META_FILE: ""}
    with quiet_torch():
        with path.open("rb") as handle:  # a file object: torch warns about non-.pt2 paths
            program = torch.export.load(handle, extra_files=extra)
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
    if not extra[META_FILE]:
        raise ModelError(f"{str(path)!r} is an exported program without 'pserver export' metadata")
    meta = _check_meta(path, json.loads(extra[META_FILE]))
    return program.module(), meta


def _load_state_dict(path: Path, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    from common.training.models import build_model

    try:
        with quiet_torch():
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch/pickle raise many types for foreign files
        raise ModelError(
            f"{str(path)!r} is not a model file written by 'pserver export': {_first_line(exc)}"
        ) from exc
    meta = _check_meta(path, saved.get("meta") if isinstance(saved, dict) else None)
    network = build_model(meta["model"], meta["bands"], meta["num_classes"], meta["height"])
    try:
        network.load_state_dict(saved["state_dict"])
    except (KeyError, RuntimeError) as exc:
        raise ModelError(f"weights in {str(path)!r} do not fit {meta['model']!r}: {exc}") from exc
    module = RawInput(network, np.asarray(meta["norm_mean"]), np.asarray(meta["norm_std"]))
    return module.eval().to(device), meta


def load_model(path: str | Path, device: torch.device | None = None) -> LoadedModel:
    """Load a file written by ``pserver export`` (either format).

    A ``program`` file is read with ``torch.export.load``; a ``state-dict`` file with
    ``torch.load(weights_only=True)`` and the model rebuilt by name (user models must be
    importable then).

    Args:
        path: the model file.
        device: where to run it (default CPU).

    Returns:
        The loaded model.

    Raises:
        ModelError: the file is missing or is not a model written by ``pserver export``.
    """
    path = Path(path)
    device = device or torch.device("cpu")
    if not path.is_file():
        raise ModelError(f"model file {str(path)!r} does not exist")
    if not zipfile.is_zipfile(path):
        raise ModelError(f"{str(path)!r} is not a model file written by 'pserver export'")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    if any(name.endswith("archive_format") for name in names):
        try:
            module, meta = _load_program(path, device)
        except ModelError:
            raise
        except Exception as exc:  # torch.export raises many internal types on bad archives
            raise ModelError(
                f"cannot load exported program {str(path)!r}: {_first_line(exc)}"
            ) from exc
    else:
        module, meta = _load_state_dict(path, device)
    return LoadedModel(path=path, meta=meta, module=module, device=device)
