"""Train/test splits: stratified random per sample, and spatially disjoint for scenes."""

from __future__ import annotations

import numpy as np
from scipy.ndimage import binary_dilation

from common.errors import DatasetError


def stratified_split(
    y: np.ndarray, train_fraction: float, seed: int, num_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices per class at random, deterministically from ``seed``.

    Each class with n samples gets ``round(train_fraction * n)`` training samples, at least 1
    and, when n >= 2, at most n - 1 (so every class present is in both splits if it can be).

    Args:
        y: labels (N,) in [0, num_classes).
        train_fraction: fraction of each class used for training, in (0, 1).
        seed: seed of the random permutation.
        num_classes: number of classes (default ``y.max() + 1``).

    Returns:
        ``(train_idx, test_idx)``: sorted, disjoint int64 arrays that together cover 0..N-1.

    Raises:
        DatasetError: ``train_fraction`` is not in (0, 1).
    """
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    y = np.asarray(y, dtype=np.int64)
    k = int(num_classes if num_classes is not None else (y.max() + 1 if y.size else 0))
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for c in range(k):
        members = np.flatnonzero(y == c)
        n = members.size
        if n == 0:
            continue
        n_train = max(1, round(train_fraction * n))
        if n >= 2:
            n_train = min(n_train, n - 1)
        perm = rng.permutation(members)
        train.append(perm[:n_train])
        test.append(perm[n_train:])
    empty = np.zeros(0, dtype=np.int64)
    tr = np.sort(np.concatenate(train)) if train else empty
    te = np.sort(np.concatenate(test)) if test else empty
    return tr.astype(np.int64), te.astype(np.int64)


def take_stratified(y: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
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
    Tiles are visited in a seeded random order; each gives the training set its pixels of the
    classes still short of ``round(train_fraction * n)`` (at least 1), up to that target, so
    every class reaches its requested count exactly. Test pixels are the labelled pixels at
    Chebyshev distance >= ``patch`` from every training pixel; pixels in the guard band
    between (including a tile's pixels that training did not take) are in neither split.

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
    short = np.maximum(1, np.round(train_fraction * np.bincount(y, minlength=k))).astype(np.int64)
    tile = (coords[:, 0] // block) * (-(-cols // block)) + coords[:, 1] // block
    order = np.argsort(tile, kind="stable")  # pixels grouped by tile, row-major within
    bounds = [*np.searchsorted(tile[order], np.unique(tile), side="left").tolist(), y.size]
    train_mask = np.zeros(y.size, dtype=bool)
    rng = np.random.default_rng(seed)
    for t in rng.permutation(len(bounds) - 1):
        members = order[bounds[t] : bounds[t + 1]]
        for c in np.unique(y[members]):
            if short[c] > 0:
                take = members[y[members] == c][: short[c]]
                train_mask[take] = True
                short[c] -= take.size
        if not short.any():
            break
    grid = np.zeros((rows, cols), dtype=bool)
    grid[coords[train_mask, 0], coords[train_mask, 1]] = True
    near = binary_dilation(grid, structure=np.ones((2 * patch - 1, 2 * patch - 1), dtype=bool))
    test_mask = ~near[coords[:, 0], coords[:, 1]]
    return np.flatnonzero(train_mask).astype(np.int64), np.flatnonzero(test_mask).astype(np.int64)
