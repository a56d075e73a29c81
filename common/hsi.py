"""Hyperspectral preparation: read .mat cubes and class maps, cut patches, write the dataset."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import scipy.io
from numpy.lib.stride_tricks import sliding_window_view
from scipy.ndimage import binary_dilation

from common.dataset import DatasetMeta, DatasetReader
from common.dataset_writer import DatasetWriter, stratified_split
from common.errors import DatasetError

log = logging.getLogger(__name__)

SPLITS = ("random", "disjoint")
BLOCK = 1024  # samples per write; bounds the memory of one block of patches
_NUMERIC = {
    "double",
    "single",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "logical",
}
_V73_MAGIC = b"MATLAB 7.3"


def split_spec(spec: str) -> tuple[Path, str | None]:
    """Split ``FILE.mat[:KEY]`` into the file path and the optional key.

    Args:
        spec: a file path, optionally followed by ``:KEY``.

    Returns:
        ``(path, key)``; key is None when omitted.

    Raises:
        DatasetError: the spec is empty.
    """
    if not spec:
        raise DatasetError("empty .mat spec: expected FILE.mat[:KEY]")
    if os.path.exists(spec) or ":" not in spec:
        return Path(spec), None
    path, key = spec.rsplit(":", 1)
    if not path or "/" in key or "\\" in key:
        return Path(spec), None
    return Path(path), key or None


def _is_v73(path: Path) -> bool:
    """True when the file is a MATLAB v7.3 (HDF5) file."""
    with path.open("rb") as fh:
        head = fh.read(len(_V73_MAGIC))
    return head == _V73_MAGIC or h5py.is_hdf5(path)


def _h5_class(obj: h5py.Dataset) -> str:
    """MATLAB class of a v7.3 dataset, inferred from the dtype when the attribute is missing."""
    cls = obj.attrs.get("MATLAB_class")
    if cls is not None:
        return cls.decode() if isinstance(cls, bytes) else str(cls)
    if obj.dtype.kind in "biuf":
        return "double" if obj.dtype.kind == "f" else "int64"
    return "unknown"


def mat_variables(path: str | os.PathLike[str]) -> list[tuple[str, tuple[int, ...], str]]:
    """List a .mat file's variables without loading them.

    Args:
        path: a MATLAB file (v4–v7.2 or v7.3).

    Returns:
        ``[(name, shape, matlab_class), ...]``; shapes in MATLAB order (rows, cols, ...).

    Raises:
        DatasetError: the file is missing or not a MAT file.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"MAT file {str(path)!r} does not exist")
    if not _is_v73(path):
        try:
            return [(n, tuple(s), c) for n, s, c in scipy.io.whosmat(path)]
        except NotImplementedError:
            pass
        except Exception as exc:
            raise DatasetError(f"{str(path)!r} is not a readable MAT file: {exc}") from exc
    try:
        with h5py.File(path, "r") as f:
            return [
                (name, tuple(reversed(obj.shape)), _h5_class(obj))
                for name, obj in f.items()
                if isinstance(obj, h5py.Dataset) and not name.startswith("#")
            ]
    except OSError as exc:
        raise DatasetError(f"{str(path)!r} is not a readable MAT v7.3 file: {exc}") from exc


def _pick_key(path: Path, key: str | None, variables: list[tuple[str, Any, str]]) -> str:
    """Choose the variable to load, or raise an error listing what the file holds."""
    found = ", ".join(f"{n} {'x'.join(map(str, s))} {c}" for n, s, c in variables) or "none"
    if key is not None:
        match = [v for v in variables if v[0] == key]
        if not match:
            raise DatasetError(f"key {key!r} not found in {str(path)!r}; keys found: {found}")
        if match[0][2] not in _NUMERIC:
            raise DatasetError(
                f"key {key!r} in {str(path)!r} is a {match[0][2]}, not a numeric array"
            )
        return key
    numeric = [n for n, _, c in variables if c in _NUMERIC and not n.startswith("__")]
    if len(numeric) != 1:
        raise DatasetError(
            f"{str(path)!r} holds {len(numeric)} numeric arrays, so give FILE.mat:KEY; "
            f"keys found: {found}"
        )
    return numeric[0]


def load_mat_array(spec: str) -> np.ndarray:
    """Load one numeric array from ``FILE.mat[:KEY]`` in MATLAB's axis order.

    MATLAB <= 7.2 files are read with scipy, v7.3 (HDF5) files with h5py, transposed back
    to (rows, cols, ...). Without KEY the file must hold exactly one numeric array.

    Args:
        spec: ``FILE.mat`` or ``FILE.mat:KEY``.

    Returns:
        The array, e.g. (rows, cols, bands) for a cube.

    Raises:
        DatasetError: the file is missing or unreadable, KEY is absent (the message lists the
            keys found) or not numeric, or KEY is omitted and the choice is ambiguous.
    """
    path, key = split_spec(spec)
    variables = mat_variables(path)
    key = _pick_key(path, key, variables)
    try:
        if _is_v73(path):
            with h5py.File(path, "r") as f:
                arr = np.asarray(f[key][...]).T
        else:
            arr = scipy.io.loadmat(path, variable_names=[key])[key]
    except (OSError, ValueError, KeyError) as exc:
        raise DatasetError(f"cannot read key {key!r} from {str(path)!r}: {exc}") from exc
    if arr.dtype.kind not in "biuf":
        raise DatasetError(f"key {key!r} in {str(path)!r} has non-numeric dtype {arr.dtype}")
    log.debug("loaded %s:%s %s %s", path, key, arr.shape, arr.dtype)
    return arr


def _h5_strings(f: h5py.File, obj: h5py.Dataset) -> list[str]:
    """Decode a v7.3 char matrix, cell array of chars, or plain HDF5 string dataset."""
    cls = obj.attrs.get("MATLAB_class")
    cls = cls.decode() if isinstance(cls, bytes) else cls
    data = obj[...]
    if obj.dtype.kind in "OSU" and cls != "cell":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in np.ravel(data)]
    if cls == "cell" or obj.dtype == h5py.ref_dtype:
        names: list[str] = []
        for ref in np.ravel(data):
            names.extend(_h5_strings(f, f[ref]))
        return names
    codes = np.atleast_2d(np.asarray(data)).T  # back to MATLAB's (rows, chars)
    return ["".join(chr(int(c)) for c in row if int(c)).strip() for row in codes]


def _to_strings(value: Any) -> list[str]:
    """Flatten what scipy gives for a cellstr or char matrix into a list of strings."""
    arr = np.asarray(value)
    if arr.dtype.kind == "U":
        return [str(s).strip() for s in arr.ravel()]
    if arr.dtype == object:
        out: list[str] = []
        for item in arr.ravel():
            out.extend(_to_strings(item))
        return out
    raise DatasetError(f"expected strings, got an array of {arr.dtype}")


def load_class_names(path: str | os.PathLike[str], key: str = "class_names") -> list[str] | None:
    """Read a list of class names stored in a .mat file, if there is one.

    Args:
        path: the MAT file (usually the ground-truth file).
        key: the variable holding a cell array or char matrix of names.

    Returns:
        The names, or None when the file has no such variable.

    Raises:
        DatasetError: the variable exists but does not hold strings.
    """
    path = Path(path)
    if key not in [n for n, _, _ in mat_variables(path)]:
        return None
    try:
        if _is_v73(path):
            with h5py.File(path, "r") as f:
                return _h5_strings(f, f[key])
        return _to_strings(scipy.io.loadmat(path, variable_names=[key])[key])
    except (DatasetError, OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{key!r} in {str(path)!r} does not hold strings: {exc}") from exc


def _take_stratified(y: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Pick at most ``cap`` indices keeping class proportions (largest remainder); sorted."""
    counts = np.bincount(y)
    share = counts * (cap / y.size)
    take = np.floor(share).astype(np.int64)
    rest = cap - int(take.sum())
    order = np.argsort(-(share - take), kind="stable")
    take[order[:rest]] += 1
    picked = [rng.choice(np.flatnonzero(y == c), int(t), replace=False) for c, t in enumerate(take)]
    return np.sort(np.concatenate(picked)).astype(np.int64)


def disjoint_split(
    coords: np.ndarray,
    y: np.ndarray,
    image_shape: tuple[int, int],
    patch: int,
    train_fraction: float,
    seed: int,
    block: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Split pixels by spatial tiles so that no test patch shares a pixel with a training patch.

    The image is cut into square tiles of ``block`` pixels (default ``max(2 * patch, 8)``).
    Tiles are visited in a seeded random order and a tile joins the training set while it holds
    a class still short of ``train_fraction`` of its pixels. Test pixels are the labelled pixels
    at Chebyshev distance >= ``patch`` from every training pixel; pixels in the guard band
    between are in neither split.

    Args:
        coords: (N, 2) row and column of each labelled pixel.
        y: (N,) class of each pixel.
        image_shape: (rows, cols) of the scene.
        patch: patch side P.
        train_fraction: wanted fraction of each class in the training split.
        seed: seed of the tile order.
        block: tile side in pixels.

    Returns:
        ``(train_idx, test_idx)`` into the N pixels, sorted and disjoint.

    Raises:
        DatasetError: ``train_fraction`` or ``block`` is out of range.
    """
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    block = block or max(2 * patch, 8)
    if block < 1:
        raise DatasetError(f"block must be >= 1, got {block}")
    rows, cols = image_shape
    k = int(y.max()) + 1
    target = np.maximum(1, np.round(train_fraction * np.bincount(y, minlength=k)))
    tile = (coords[:, 0] // block) * (-(-cols // block)) + coords[:, 1] // block
    have = np.zeros(k, dtype=np.int64)
    train_mask = np.zeros(y.size, dtype=bool)
    rng = np.random.default_rng(seed)
    for t in rng.permutation(np.unique(tile)):
        members = tile == t
        counts = np.bincount(y[members], minlength=k)
        if np.any((counts > 0) & (have < target)):
            train_mask |= members
            have += counts
    grid = np.zeros((rows, cols), dtype=bool)
    grid[coords[train_mask, 0], coords[train_mask, 1]] = True
    near = binary_dilation(grid, structure=np.ones((2 * patch - 1, 2 * patch - 1), dtype=bool))
    test_mask = ~near[coords[:, 0], coords[:, 1]]
    return np.flatnonzero(train_mask).astype(np.int64), np.flatnonzero(test_mask).astype(np.int64)


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
        keep = _take_stratified(y, max_samples, np.random.default_rng([seed, 1]))
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
        log.warning("class %d (%s) has no test samples", c, class_names[c])
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
