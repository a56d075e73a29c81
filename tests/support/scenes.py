"""Scenes in the layouts unmixing benchmarks ship: bands x pixels and abundances."""

from __future__ import annotations

import numpy as np


def to_matrix(cube: np.ndarray) -> np.ndarray:
    """(rows, cols, bands) -> bands x pixels with pixels in column-major (MATLAB) order."""
    return cube.transpose(2, 1, 0).reshape(cube.shape[2], -1)


def abundances_for(gt: np.ndarray, k: int) -> np.ndarray:
    """End-members x pixels abundances whose argmax (at >= 0.5) gives back the class map.

    A labelled pixel of class c has 0.7 for c and the rest shared; an unlabelled one has a
    largest abundance of 0.4, below the 0.5 at which Jasper Ridge's class map was made.
    """
    rows, cols = gt.shape
    maps = np.full((rows, cols, k), 0.3 / (k - 1))
    for c in range(1, k + 1):
        maps[gt == c, c - 1] = 0.7
    maps[gt == 0] = [0.4] + [0.6 / (k - 1)] * (k - 1)
    return to_matrix(maps)
