"""Classifying every pixel of a scene with an exported model, streamed band by band."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from tqdm import tqdm

from common.data.convert.patches import iter_bands
from common.data.convert.raster import Cube
from common.errors import DatasetError, ModelError
from common.training.metrics import Scores, confusion_matrix, scores_from_confusion
from pserver.outputs.model_file import LoadedModel

log = logging.getLogger(__name__)


def check_scene(model: LoadedModel, cube: Cube) -> int:
    """Check that ``model`` classifies pixels of scenes like ``cube``.

    Returns:
        The patch side P.

    Raises:
        ModelError: the model classifies whole images, not pixels.
        DatasetError: the cube's band count differs from the model's.
    """
    meta = model.meta
    if meta["kind"] != "hsi":
        raise ModelError(
            f"model {str(model.path)!r} classifies whole images ({meta['kind']}); "
            "use --images DIR instead of --cube"
        )
    bands = cube.shape[2]
    if bands != meta["bands"]:
        raise DatasetError(
            f"cube {cube.spec!r} has {bands} bands but model {str(model.path)!r} was trained on "
            f"{meta['bands']}"
        )
    return int(meta["patch"])


def predict_scene(
    model: LoadedModel,
    cube: Cube,
    batch: int = 1024,
    progress: bool = True,
    proba: np.ndarray | None = None,
) -> np.ndarray:
    """Classify every pixel of ``cube`` from the P x P patch around it (reflect padding).

    The cube is read a band of rows at a time (windowed for ENVI and GeoTIFF), and patches go
    to the model ``batch`` at a time, so memory holds one band, one batch and the map itself.
    A pixel whose patch holds a NaN or infinite value is not classified: it gets the no-data
    index K (``nodata_index``; count them with ``count_nodata``).

    Args:
        model: an exported pixel classifier (kind ``hsi``).
        cube: the scene, with the model's band count.
        batch: patches per forward pass.
        progress: show a progress bar (pixels) on stderr.
        proba: a C-contiguous (rows, cols, K) float32 array to fill with the softmax class
            probabilities (NaN for no data); the map is then their argmax. None: the argmax
            of the logits.

    Returns:
        The (rows, cols) class indices 0..K-1, K for no data (uint8 for up to 255 classes,
        else uint16).

    Raises:
        ModelError, DatasetError: see ``check_scene``; DatasetError when ``batch`` < 1, the
            cube is unreadable or ``proba`` is not such an array.
    """
    if batch < 1:
        raise DatasetError(f"batch must be >= 1, got {batch}")
    patch = check_scene(model, cube)
    rows, cols, _ = cube.shape
    nodata = nodata_index(model.class_names)
    out = np.zeros((rows, cols), dtype=np.uint8 if nodata <= 255 else np.uint16)
    flat = out.reshape(-1)
    if proba is not None and (
        proba.shape != (rows, cols, nodata)
        or proba.dtype != np.float32
        or not proba.flags.c_contiguous
    ):
        raise DatasetError(f"proba must be a C-contiguous ({rows}, {cols}, {nodata}) float32 array")
    probs = None if proba is None else proba.reshape(rows * cols, nodata)
    bar = tqdm(total=rows * cols, unit="px", unit_scale=True, desc="predict", disable=not progress)
    with bar:
        for start, stop, windows in iter_bands(cube, patch):
            n = (stop - start) * cols
            for first in range(0, n, batch):
                r, c = np.divmod(np.arange(first, min(n, first + batch)), cols)
                patches, at = windows[r, c], start * cols + first
                finite = np.isfinite(patches).reshape(len(patches), -1).all(axis=1)
                if probs is None:
                    predicted = np.full(len(patches), nodata, dtype=np.int64)
                    if finite.any():
                        predicted[finite] = model.classify(patches[finite])
                else:
                    p = probs[at : at + len(patches)]
                    p[...] = np.nan
                    if finite.any():
                        p[finite] = model.probabilities(patches[finite])
                    predicted = np.where(np.isfinite(p).all(axis=1), p.argmax(axis=1), nodata)
                flat[at : at + len(patches)] = predicted
                bar.update(len(patches))
            del windows  # one band in memory at a time
    return out


def nodata_index(class_names: list[str]) -> int:
    """The map value of a pixel that was not classified: K, one past the last class."""
    return len(class_names)


def count_nodata(classes: np.ndarray, class_names: list[str]) -> int:
    """How many pixels of a map were not classified."""
    return int(np.count_nonzero(classes == nodata_index(class_names)))


def score_map(classes: np.ndarray, gt: np.ndarray, num_classes: int) -> Scores:
    """OA, AA, kappa and per-class accuracy of a map on the labelled pixels of ``gt`` that were
    classified (no-data pixels, index K, are left out).

    Args:
        classes: (rows, cols) predicted class indices.
        gt: (rows, cols) ground truth, 0 = unlabelled, k + 1 = class k.
        num_classes: K.

    Returns:
        The scores (loss is NaN: a map has no loss).

    Raises:
        DatasetError: the shapes differ or ``gt`` has labels above K.
    """
    if gt.shape != classes.shape:
        raise DatasetError(
            f"ground truth is {gt.shape[0]}x{gt.shape[1]} but the scene is "
            f"{classes.shape[0]}x{classes.shape[1]} (rows x cols)"
        )
    if gt.max(initial=0) > num_classes:
        raise DatasetError(
            f"ground truth has label {int(gt.max())} but the model knows {num_classes} classes"
        )
    labelled = (gt > 0) & (classes < num_classes)  # no-data pixels are left out
    matrix = confusion_matrix(gt[labelled] - 1, classes[labelled], num_classes)
    return scores_from_confusion(matrix, float("nan"))


def scores_report(scores: Scores, names: list[str]) -> dict[str, Any]:
    """Scores of a map as JSON-able data: ``{"labelled", "oa", "aa", "kappa", "per_class"}``."""
    return {
        "labelled": int(sum(scores.support)),
        "oa": scores.oa,
        "aa": scores.aa,
        "kappa": scores.kappa,
        "per_class": scores.per_class(names),
    }
