"""Hyperspectral preparation: read .mat cubes and class maps, cut patches, write the dataset."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from common.data.codec import RAW_DTYPES
from common.data.convert.cube import load_labels, open_cube
from common.data.convert.layout import DEFAULT_MIN_ABUNDANCE, abundance_labels
from common.data.convert.patches import iter_bands, rows_per_band
from common.data.convert.raster import ArrayCube, Cube
from common.data.dataset import DatasetMeta, DatasetReader
from common.data.splits import disjoint_split, stratified_split, take_stratified
from common.data.writer import DatasetWriter
from common.errors import DatasetError

log = logging.getLogger(__name__)

SPLITS = ("random", "disjoint")
BLOCK = 1024  # samples per write; bounds the memory of one block of patches


def _train_statistics(
    cube: Cube, train_coords: np.ndarray, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Per-band mean and std (float64) of the training pixels, read band by band; checks that
    the whole cube is finite.

    Raises:
        DatasetError: the cube holds NaN or Inf, or cannot be read.
    """
    rows, cols, bands = cube.shape
    step = rows_per_band(cols, bands, 1)
    parts = []
    bar = tqdm(total=rows, desc="pass 1/2 (statistics)", unit="row", disable=not progress)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        bar.update(stop - start)
        block = cube.read_rows(start, stop)
        if block.dtype.kind == "f" and not np.all(np.isfinite(block)):
            raise DatasetError(f"cube {cube.spec!r} contains NaN or Inf (rows {start}:{stop})")
        inside = train_coords[(train_coords[:, 0] >= start) & (train_coords[:, 0] < stop)]
        parts.append(block[inside[:, 0] - start, inside[:, 1]].astype(np.float64))
    bar.close()
    pixels = np.concatenate(parts)
    mean = pixels.mean(axis=0)
    std = pixels.std(axis=0)
    std[std < 1e-12] = 1.0
    return mean, std


def write_patch_dataset(
    cube: np.ndarray | Cube,
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
    x_dtype: str = "float32",
    progress: bool = False,
) -> DatasetMeta:
    """Turn a cube and a class map into a patch dataset file (the one HSI pipeline).

    Picks the labelled pixels (optionally capped), splits them, normalises every band with the
    mean and std of the training pixels, reflect-pads the cube and streams (C, P, P) patches
    centred on each labelled pixel, in row-major pixel order, to ``out``. The cube is read
    twice, a band of rows at a time (statistics, then patches).

    Args:
        cube: (rows, cols, bands) numeric array, or an open ``Cube`` (read band by band, so
            ENVI and GeoTIFF scenes need not fit in memory).
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
        x_dtype: as for ``prepare_hsi``.
        progress: show a progress bar per pass over the cube (rows read) on stderr.

    Returns:
        The written dataset's metadata; ``common.data.split_report`` turns it into the per-class
        table and warnings (a class without test samples, a realised fraction off the request).

    Raises:
        DatasetError: an argument is invalid or no pixel is labelled.
    """
    if isinstance(cube, np.ndarray):
        cube = ArrayCube(cube)
    rows, cols, bands = cube.shape
    if labels.shape != (rows, cols):
        raise DatasetError(
            f"class map shape {labels.shape} does not match cube rows x cols {(rows, cols)}"
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
    labelled = np.bincount(y, minlength=k)
    if split == "random":
        train, test = stratified_split(y, train_fraction, seed, k)
    else:
        train, test = disjoint_split(coords, y, (rows, cols), patch, train_fraction, seed)
        keep = np.union1d(train, test)
        remap = np.full(y.size, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        log.info("disjoint split: %d pixels in the guard band are left out", y.size - keep.size)
        coords, y, train, test = coords[keep], y[keep], remap[train], remap[test]
    mean, std = _train_statistics(cube, coords[train], progress)
    stored = _stored_dtype(cube, x_dtype)
    normalise_now = stored not in RAW_DTYPES
    attrs = {
        "patch": int(patch),
        "split": split,
        "train_fraction": float(train_fraction),
        "seed": int(seed),
        "image_shape": [int(rows), int(cols)],
        "labelled_per_class": [int(n) for n in labelled],
        **(extra_attrs or {}),
    }
    # Pixels are in row-major order, so one top-to-bottom pass over bands of rows writes them
    # in file order; only one reflect-padded, normalised band is in memory at a time.
    row_starts = np.searchsorted(coords[:, 0], np.arange(rows + 1))
    shape = (bands, patch, patch)
    bar = tqdm(total=rows, desc="pass 2/2 (patches)", unit="row", disable=not progress)
    with (
        bar,
        DatasetWriter(
            out,
            shape,
            num_samples=y.size,
            kind="hsi",
            class_names=class_names,
            source=source,
            x_dtype=stored,
        ) as w,
    ):
        scaling = (mean, std) if normalise_now else (None, None)
        for start, stop, windows in iter_bands(cube, patch, *scaling):
            bar.update(stop - start)
            lo, hi = int(row_starts[start]), int(row_starts[stop])
            for first in range(lo, hi, BLOCK):
                rc = coords[first : min(hi, first + BLOCK)]
                w.write(windows[rc[:, 0] - start, rc[:, 1]], y[first : first + len(rc)])
            del windows  # one band in memory at a time
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


def _stored_dtype(cube: np.ndarray | Cube, x_dtype: str) -> str:
    """The dtype ``/x`` is written in: ``raw`` keeps the cube's integers (normalised on read)."""
    if x_dtype != "raw":
        return x_dtype
    if np.dtype(cube.dtype).name not in RAW_DTYPES:
        raise DatasetError(
            f"--x-dtype raw keeps the cube's integers, but the cube is {cube.dtype} "
            f"(raw works for {', '.join(RAW_DTYPES)}); use float32 or float16"
        )
    return np.dtype(cube.dtype).name


def prepare_hsi(
    cube_spec: str,
    gt_spec: str,
    out: str | os.PathLike[str],
    patch: int = 5,
    train_fraction: float = 0.1,
    split: str = "random",
    seed: int = 0,
    class_names: Sequence[str] | None = None,
    x_dtype: str = "float32",
    progress: bool = False,
    shape: tuple[int, int] | None = None,
    bands_first: bool = False,
    gt_abundance: bool = False,
    min_abundance: float = DEFAULT_MIN_ABUNDANCE,
) -> DatasetMeta:
    """Prepare a patch dataset from a hyperspectral cube and a ground-truth map.

    A .mat cube may also be (bands, rows, cols) (``bands_first``) or a bands x pixels matrix
    with ``nRow``/``nCol`` in the file or ``shape`` given, as unmixing scenes are distributed
    (see ``common.data.convert.layout``); the layout read is stored in the ``layout`` attribute.

    Args:
        cube_spec: the (rows, cols, bands) cube: ``FILE.mat[:KEY]`` (loaded whole), an ENVI
            file (``.hdr`` or its data file) or a multi-band GeoTIFF (both read a band of rows
            at a time, so they need not fit in memory).
        gt_spec: the (rows, cols) class map, ``FILE.mat[:KEY]``, a single-band GeoTIFF or an
            ENVI classification file; 0 = unlabelled, 1..K = classes 0..K-1. Class names come
            from a ``class_names`` variable (.mat) or the ENVI header's ``class names``.
        out: the dataset file to write.
        patch: odd patch side P >= 1.
        train_fraction: training fraction per class, in (0, 1).
        split: ``"random"`` or ``"disjoint"`` (spatially disjoint; see docs/data.md).
        seed: seed of the split.
        class_names: names of classes 1..K; override those found in the files.
        x_dtype: how samples are stored: ``float32`` or ``float16`` (normalised), or ``raw``
            (the cube's integers, normalised on read; half the bytes of float32 for uint16).
        progress: show progress bars on stderr.
        shape: (rows, cols) of a bands x pixels .mat matrix (overrides nRow/nCol).
        bands_first: a .mat cube is (bands, rows, cols), or its matrix is bands x pixels.
        gt_abundance: ``gt_spec`` holds abundances (end-members x pixels or (rows, cols,
            end-members)); each pixel is labelled with its most abundant end-member.
        min_abundance: with ``gt_abundance``, pixels whose largest abundance is below this
            are unlabelled.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: a file or key is missing, shapes disagree, labels are not non-negative
            integers, or an argument is out of range.
    """
    with open_cube(cube_spec, shape, bands_first) as cube:
        rows, cols, bands = cube.shape
        layout = cube.layout or f"rows x cols x bands ({rows} x {cols} x {bands})"
        if gt_abundance:
            gt, names, gt_layout = abundance_labels(gt_spec, (rows, cols), min_abundance)
            gt_georef = None
        else:
            gt, names, gt_georef = load_labels(gt_spec)
            gt_layout = "class map (rows x cols)"
        if gt.shape != (rows, cols):
            raise DatasetError(
                f"ground truth {gt_spec!r} is {gt.shape[0]}x{gt.shape[1]} but cube "
                f"{cube_spec!r} is {rows}x{cols} (rows x cols)"
                + ("; for abundance maps add --gt-abundance" if gt.shape[1] == rows * cols else "")
            )
        if gt_georef is not None and cube.georef is not None and gt_georef != cube.georef:
            log.warning(
                "ground truth %s and cube %s are georeferenced differently", gt_spec, cube_spec
            )
        num_labels = int(gt.max())
        where = "class_names"
        if class_names is not None:
            names, where = [str(n) for n in class_names], "--classes"
        if names is not None and len(names) < num_labels:
            raise DatasetError(
                f"ground truth {gt_spec!r} has labels up to {num_labels} but {where} lists "
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
            extra_attrs={"layout": layout, "gt_layout": gt_layout},
            x_dtype=x_dtype,
            progress=progress,
        )
