"""Hyperspectral preparation: read .mat cubes and class maps, cut patches, write the dataset."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from common.data.convert.matfile import load_class_names, load_mat_array, split_spec
from common.data.dataset import DatasetMeta, DatasetReader
from common.data.splits import disjoint_split, stratified_split, take_stratified
from common.data.writer import DatasetWriter
from common.errors import DatasetError

log = logging.getLogger(__name__)

SPLITS = ("random", "disjoint")
BLOCK = 1024  # samples per write; bounds the memory of one block of patches


def write_patch_dataset(
    cube: np.ndarray,
    labels: np.ndarray,
    out: str | os.PathLike[str],
    *,
    class_names: Sequence[str],
    patch: int = 5,
    train_fraction: float = 0.1,
    split: str = "random",
    seed: int = 0,
    max_samples: int | None = None,
    source: str = "",
    extra_attrs: dict[str, Any] | None = None,
) -> DatasetMeta:
    """Turn a cube and a class map into a patch dataset file (the one HSI pipeline).

    Picks the labelled pixels (optionally capped), splits them, normalises every band with the
    mean and std of the training pixels, reflect-pads the cube and streams (C, P, P) patches
    centred on each labelled pixel, in row-major pixel order, to ``out``.

    Args:
        cube: (rows, cols, bands) numeric array.
        labels: (rows, cols) int array, -1 for unlabelled and 0..K-1 for classes.
        out: the dataset file to write.
        class_names: K names.
        patch: odd patch side P >= 1.
        train_fraction: training fraction per class, in (0, 1).
        split: ``"random"`` (stratified per pixel) or ``"disjoint"`` (see ``disjoint_split``).
        seed: seed of the split and of the ``max_samples`` subsample.
        max_samples: keep at most this many labelled pixels (stratified); None keeps all.
        source: free text stored in the file.
        extra_attrs: more root attributes.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: an argument is invalid or no pixel is labelled.
    """
    if cube.ndim != 3:
        raise DatasetError(f"cube must be (rows, cols, bands), got shape {cube.shape}")
    if labels.shape != cube.shape[:2]:
        raise DatasetError(
            f"class map shape {labels.shape} does not match cube rows x cols {cube.shape[:2]}"
        )
    if not (isinstance(patch, (int, np.integer)) and patch >= 1 and patch % 2 == 1):
        raise DatasetError(f"patch must be an odd integer >= 1, got {patch!r}")
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    if split not in SPLITS:
        raise DatasetError(f"split must be one of {SPLITS}, got {split!r}")
    if max_samples is not None and max_samples < 2:
        raise DatasetError(f"max_samples must be >= 2, got {max_samples}")
    k = len(class_names)
    labels = np.asarray(labels, dtype=np.int64)
    if labels.max() >= k:
        raise DatasetError(f"class map has label {int(labels.max())} but only {k} class names")
    coords = np.argwhere(labels >= 0).astype(np.int64)
    if coords.size == 0:
        raise DatasetError("the class map has no labelled pixels")
    y = labels[coords[:, 0], coords[:, 1]]
    if max_samples is not None and max_samples < y.size:
        keep = take_stratified(y, max_samples, np.random.default_rng([seed, 1]))
        coords, y = coords[keep], y[keep]
    if split == "random":
        train, test = stratified_split(y, train_fraction, seed, k)
    else:
        train, test = disjoint_split(coords, y, cube.shape[:2], patch, train_fraction, seed)
        keep = np.union1d(train, test)
        remap = np.full(y.size, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        log.info("disjoint split: %d pixels in the guard band are left out", y.size - keep.size)
        coords, y, train, test = coords[keep], y[keep], remap[train], remap[test]
    for c in np.flatnonzero(np.bincount(y[test], minlength=k) == 0):
        log.warning("class %d (%s) has no test samples", c, class_names[int(c)])
    train_pixels = cube[coords[train, 0], coords[train, 1]].astype(np.float64)
    mean = train_pixels.mean(axis=0)
    std = train_pixels.std(axis=0)
    std[std < 1e-12] = 1.0
    norm = cube.astype(np.float32)  # in place from here: cubes can be large
    norm -= mean.astype(np.float32)
    norm /= std.astype(np.float32)
    r = patch // 2
    padded = np.pad(norm, ((r, r), (r, r), (0, 0)), mode="reflect") if r else norm
    windows = sliding_window_view(padded, (patch, patch), axis=(0, 1))  # rows, cols, C, P, P
    attrs = {
        "patch": int(patch),
        "split": split,
        "train_fraction": float(train_fraction),
        "seed": int(seed),
        "image_shape": [int(cube.shape[0]), int(cube.shape[1])],
        **(extra_attrs or {}),
    }
    bands = cube.shape[2]
    with DatasetWriter(out, (bands, patch, patch), y.size, "hsi", class_names, source) as w:
        for start in range(0, y.size, BLOCK):
            rc = coords[start : start + BLOCK]
            w.write(windows[rc[:, 0], rc[:, 1]], y[start : start + BLOCK])
        w.close(
            train,
            test,
            extra_attrs=attrs,
            norm_mean=mean,
            norm_std=std,
            extra_datasets={"coords": coords.astype(np.int32)},
        )
    with DatasetReader(out, cache_bytes=0) as reader:
        return reader.meta


def prepare_hsi(
    cube_spec: str,
    gt_spec: str,
    out: str | os.PathLike[str],
    patch: int = 5,
    train_fraction: float = 0.1,
    split: str = "random",
    seed: int = 0,
) -> DatasetMeta:
    """Prepare a patch dataset from a hyperspectral cube and a ground-truth map in .mat files.

    Args:
        cube_spec: ``FILE.mat[:KEY]`` of the (rows, cols, bands) cube.
        gt_spec: ``FILE.mat[:KEY]`` of the (rows, cols) class map; 0 = unlabelled, 1..K =
            classes 0..K-1. A ``class_names`` variable in that file names the classes.
        out: the dataset file to write.
        patch: odd patch side P >= 1.
        train_fraction: training fraction per class, in (0, 1).
        split: ``"random"`` or ``"disjoint"`` (spatially disjoint; see docs/data.md).
        seed: seed of the split.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: a file or key is missing, shapes disagree, labels are not non-negative
            integers, or an argument is out of range.
    """
    if not (isinstance(patch, (int, np.integer)) and patch >= 1 and patch % 2 == 1):
        raise DatasetError(f"patch must be an odd integer >= 1, got {patch!r}")
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    if split not in SPLITS:
        raise DatasetError(f"split must be one of {SPLITS}, got {split!r}")
    cube = load_mat_array(cube_spec)
    gt = load_mat_array(gt_spec)
    if cube.ndim != 3:
        raise DatasetError(f"cube {cube_spec!r} must be (rows, cols, bands), got {cube.shape}")
    if gt.ndim != 2:
        raise DatasetError(f"ground truth {gt_spec!r} must be (rows, cols), got {gt.shape}")
    if gt.shape != cube.shape[:2]:
        raise DatasetError(
            f"ground truth {gt_spec!r} is {gt.shape[0]}x{gt.shape[1]} but cube {cube_spec!r} "
            f"is {cube.shape[0]}x{cube.shape[1]} (rows x cols)"
        )
    if not np.all(np.isfinite(cube)):
        raise DatasetError(f"cube {cube_spec!r} contains NaN or Inf")
    if gt.dtype.kind == "f" and not np.all(np.mod(gt, 1) == 0):
        raise DatasetError(f"ground truth {gt_spec!r} has non-integer labels")
    if gt.min() < 0:
        raise DatasetError(f"ground truth {gt_spec!r} has negative label {gt.min()}")
    gt = gt.astype(np.int64)
    num_labels = int(gt.max())
    names = load_class_names(split_spec(gt_spec)[0])
    if names is not None and len(names) < num_labels:
        raise DatasetError(
            f"ground truth {gt_spec!r} has labels up to {num_labels} but class_names lists "
            f"only {len(names)}: {names}"
        )
    if names is None:
        names = [f"class_{i}" for i in range(1, num_labels + 1)]
    return write_patch_dataset(
        cube,
        gt - 1,
        out,
        class_names=names,
        patch=patch,
        train_fraction=train_fraction,
        split=split,
        seed=seed,
        source=f"prepare hsi --cube {cube_spec} --gt {gt_spec}",
    )
