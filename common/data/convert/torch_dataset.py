"""A map-style torch Dataset (torchgeo dict samples or (x, y) tuples) into a dataset file."""

from __future__ import annotations

import ast
import importlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.data.dataset import DatasetMeta
from common.data.splits import stratified_split
from common.data.writer import write_scenes
from common.errors import DatasetError

log = logging.getLogger(__name__)


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """Parse ``k=v,k2=v2``: each value a Python literal (number, True/False/None, quoted
    string, list in brackets without commas) or else a plain string.

    Raises:
        DatasetError: an item has no ``=`` or an empty name.
    """
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise DatasetError(f"--kwargs item {item!r} is not NAME=VALUE")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def load_dataset(spec: str, kwargs: dict[str, Any]) -> Any:
    """Import ``package.module:Factory`` and call it with ``kwargs``.

    Returns:
        The dataset: it must have ``__len__`` and ``__getitem__``.

    Raises:
        DatasetError: the factory cannot be imported or fails, or the result is not map-style.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DatasetError(f"--dataset must be package.module:Factory, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise DatasetError(f"cannot import {spec!r}: {exc}") from exc
    try:
        dataset = factory(**kwargs)
    except Exception as exc:  # a user's factory may raise anything
        raise DatasetError(f"{spec}({kwargs}) failed: {type(exc).__name__}: {exc}") from exc
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DatasetError(f"{spec} returned {type(dataset).__name__}, not a map-style Dataset")
    return dataset


def _array(value: Any) -> np.ndarray:
    """A tensor, array or PIL image as a numpy array (PIL images become channels-first)."""
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    if hasattr(value, "getbands"):  # a PIL image: (H, W[, C])
        arr = np.asarray(value)
        return arr if arr.ndim == 2 else np.moveaxis(arr, -1, 0)
    return np.asarray(value)


def sample_arrays(sample: Any, index: int) -> tuple[np.ndarray, int]:
    """One sample as ``(float32 (C, H, W) image, integer label)``.

    Args:
        sample: ``{"image", "label"}`` (torchgeo) or ``(x, y)``.
        index: its index, for messages.

    Raises:
        DatasetError: the sample has another layout, a non-numeric or non-2-D image, a
            non-integer label, or NaN/Inf values.
    """
    if isinstance(sample, dict):
        if "image" not in sample or "label" not in sample:
            kind = " (a segmentation mask is not a class label)" if "mask" in sample else ""
            raise DatasetError(
                f"sample {index} has keys {sorted(sample)}; expected 'image' and 'label'{kind}"
            )
        x, y = sample["image"], sample["label"]
    elif isinstance(sample, (tuple, list)) and len(sample) >= 2:
        x, y = sample[0], sample[1]
    else:
        raise DatasetError(
            f"sample {index} is a {type(sample).__name__}; expected a dict with 'image' and "
            "'label' or an (x, y) tuple"
        )
    image = _array(x)
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3 or image.dtype.kind not in "biuf" or min(image.shape) < 1:
        raise DatasetError(
            f"sample {index}: image must be numeric (C, H, W), got {image.dtype} {image.shape}"
        )
    label = _array(y)
    if label.size != 1 or label.dtype.kind not in "biu":
        raise DatasetError(f"sample {index}: label must be one integer, got {label!r}")
    image = image.astype(np.float32)
    if not np.all(np.isfinite(image)):
        raise DatasetError(f"sample {index}: image contains NaN or Inf")
    return image, int(label.reshape(-1)[0])


def _names(dataset: Any, class_names: Sequence[str] | None, labels: np.ndarray) -> list[str]:
    """Class names from --classes, else the dataset's ``classes``, else class_0..class_K-1."""
    if class_names is not None:
        names = [str(n) for n in class_names]
    else:
        found = getattr(dataset, "classes", None)
        if isinstance(found, (list, tuple)) and found and all(isinstance(n, str) for n in found):
            names = list(found)
        else:
            names = [f"class_{k}" for k in range(int(labels.max()) + 1)]
    if labels.min() < 0 or labels.max() >= len(names):
        raise DatasetError(
            f"labels run from {int(labels.min())} to {int(labels.max())} but there are "
            f"{len(names)} class names: {names}"
        )
    return names


def prepare_torch(
    spec: str,
    out: str | os.PathLike[str],
    kwargs: dict[str, Any] | None = None,
    class_names: Sequence[str] | None = None,
    train_fraction: float = 0.8,
    seed: int = 0,
    progress: bool = True,
) -> DatasetMeta:
    """Stream a map-style torch Dataset into a scenes dataset file.

    Two passes, as for image folders (``write_scenes``): the first reads every sample (checks
    one shape, collects labels and per-sample band statistics), the split is made
    (stratified), the second reads every sample again, normalises it with the training
    samples' per-band mean and std and writes it in blocks. The dataset must return the same
    sample for the same index (no random transforms): the second pass checks labels and means.

    Args:
        spec: ``package.module:Factory`` returning the dataset.
        out: the dataset file to write.
        kwargs: keyword arguments of the factory.
        class_names: class names (default: the dataset's ``classes`` attribute).
        train_fraction: training fraction per class, in (0, 1).
        seed: seed of the split.
        progress: show progress bars on stderr.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: see ``load_dataset`` and ``sample_arrays``; samples of different shapes,
            labels beyond the class names, an empty dataset, or samples that change between
            reads.
    """
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    dataset = load_dataset(spec, kwargs or {})
    n = len(dataset)
    if n < 2:
        raise DatasetError(f"{spec} has {n} samples; a dataset needs at least 2")
    shapes: list[tuple[int, ...]] = []

    def read(i: int) -> tuple[np.ndarray, int]:
        image, label = sample_arrays(dataset[i], i)
        if not shapes:
            shapes.append(image.shape)
        if image.shape != shapes[0]:
            raise DatasetError(
                f"sample {i} is {image.shape} but sample 0 is {shapes[0]} (bands, rows, cols): "
                "all samples must share one shape"
            )
        return image, label

    def split(labels: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
        names = _names(dataset, class_names, labels)
        return names, *stratified_split(labels, train_fraction, seed, len(names))

    return write_scenes(
        out,
        read,
        n,
        split,
        source=f"prepare torch --dataset {spec}" + (f" --kwargs {kwargs}" if kwargs else ""),
        progress=progress,
        extra_attrs={"train_fraction": float(train_fraction), "seed": int(seed)},
    )
