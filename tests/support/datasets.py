"""Small datasets written sample by sample, in a stored dtype of the test's choosing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data.splits import stratified_split
from common.data.writer import DatasetWriter

SHAPE = (3, 4, 4)


def raw_samples(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """``n`` raw uint16 samples of ``SHAPE`` and labels cycling over three classes."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 60000, size=(n, *SHAPE)).astype(np.uint16)
    return x, np.arange(n) % 3


def write_dataset(path: Path, x: np.ndarray, y: np.ndarray, x_dtype: str, **close: object) -> str:
    """A three-class dataset of ``x`` stored as ``x_dtype``, half for training; its fingerprint."""
    train, test = stratified_split(y, 0.5, seed=0, num_classes=3)
    with DatasetWriter(
        path, SHAPE, num_samples=len(y), kind="scenes", class_names=["a", "b", "c"], x_dtype=x_dtype
    ) as w:
        w.write(x[:17], y[:17])
        w.write(x[17:], y[17:])
        return w.close(train, test, **close)  # type: ignore[arg-type]
