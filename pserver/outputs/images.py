"""Classifying a folder of images with an exported scene model, into a CSV file."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from common.data.convert.folder import SUFFIXES, read_image
from common.errors import DatasetError, ModelError
from pserver.outputs.model_file import LoadedModel

log = logging.getLogger(__name__)

COLUMNS = ("file", "class", "index", "confidence")


def list_images(directory: Path) -> list[Path]:
    """Every image (.tif, .tiff, .png, .jpg, .jpeg) under ``directory``, sorted; hidden
    files and folders are skipped.

    Raises:
        DatasetError: ``directory`` is not a folder or holds no image.
    """
    if not directory.is_dir():
        raise DatasetError(f"{str(directory)!r} is not a folder")
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [
            Path(root) / f
            for f in files
            if not f.startswith(".") and Path(f).suffix.lower() in SUFFIXES
        ]
    if not found:
        raise DatasetError(f"{str(directory)!r} holds no .tif/.tiff/.png/.jpg/.jpeg images")
    return sorted(found)


def _read(model: LoadedModel, path: Path) -> np.ndarray:
    """One image as the model's raw input, resized when the training set was."""
    image = read_image(path, model.meta.get("resize"))
    if image.shape != model.input_shape:
        shape = "x".join(map(str, image.shape))
        want = "x".join(map(str, model.input_shape))
        raise DatasetError(
            f"image {str(path)!r} is {shape} (bands x rows x cols) but model "
            f"{str(model.path)!r} takes {want}"
        )
    return image


def predict_images(
    model: LoadedModel, directory: Path, out: Path, batch: int = 64, progress: bool = True
) -> dict[str, Any]:
    """Classify every image under ``directory`` and write one CSV row per image.

    Columns: ``file`` (relative to ``directory``), ``class`` (name), ``index``,
    ``confidence`` (softmax probability of that class), and ``true`` when every image sits in
    a folder named after one of the model's classes (the EuroSAT layout).

    Args:
        model: an exported scene classifier (kind ``scenes``).
        directory: the folder of images (searched recursively).
        out: the CSV file to write.
        batch: images per forward pass.
        progress: show a progress bar on stderr.

    Returns:
        ``{"images", "accuracy"}``; accuracy is None without ``true`` labels.

    Raises:
        ModelError: the model classifies pixels of scenes, not images.
        DatasetError: no images, an unreadable image, or one of the wrong shape.
    """
    if model.meta["kind"] != "scenes":
        raise ModelError(
            f"model {str(model.path)!r} classifies pixels of hyperspectral scenes; "
            "use --cube FILE instead of --images"
        )
    if batch < 1:
        raise DatasetError(f"batch must be >= 1, got {batch}")
    files = list_images(directory)
    names = model.class_names
    truth = [f.parent.name for f in files]
    labelled = all(t in names for t in truth)
    correct = 0
    with (
        out.open("w", newline="", encoding="utf-8") as handle,
        tqdm(total=len(files), unit="img", desc="predict", disable=not progress) as bar,
    ):
        writer = csv.writer(handle)
        writer.writerow([*COLUMNS, "true"] if labelled else COLUMNS)
        for first in range(0, len(files), batch):
            chunk = files[first : first + batch]
            probs = model.probabilities(np.stack([_read(model, f) for f in chunk]))
            for k, (path, p) in enumerate(zip(chunk, probs, strict=True)):
                index = int(p.argmax())
                row = [
                    path.relative_to(directory).as_posix(),
                    names[index],
                    index,
                    f"{p[index]:.4f}",
                ]
                if labelled:
                    row.append(truth[first + k])
                    correct += names[index] == truth[first + k]
                writer.writerow(row)
            bar.update(len(chunk))
    return {"images": len(files), "accuracy": correct / len(files) if labelled else None}
