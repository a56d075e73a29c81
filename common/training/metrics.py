"""Classification metrics on the test split: OA, AA, Cohen's kappa, per-class accuracy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Scores:
    """OA, AA (mean per-class recall over classes present), kappa and mean loss.

    Attributes:
        accuracy: per-class recall, None for a class without test samples.
        support: per-class count of test samples.
        confusion: ``m[true][pred]`` counts.
    """

    oa: float
    aa: float
    kappa: float
    loss: float
    accuracy: tuple[float | None, ...] = ()
    support: tuple[int, ...] = ()
    confusion: tuple[tuple[int, ...], ...] = ()

    def per_class(self, names: Sequence[str]) -> dict[str, Any]:
        """The ``per_class`` map of ``summary.json``.

        Args:
            names: the class names, one per row of the confusion matrix.

        Returns:
            ``{"names", "accuracy", "support", "confusion"}``.
        """
        return {
            "names": list(names),
            "accuracy": list(self.accuracy),
            "support": list(self.support),
            "confusion": [list(row) for row in self.confusion],
        }


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts ``m[true, pred]`` as an int64 ``num_classes`` x ``num_classes`` matrix."""
    idx = y_true.astype(np.int64) * num_classes + y_pred.astype(np.int64)
    return np.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def scores_from_confusion(matrix: np.ndarray, loss: float) -> Scores:
    """OA, AA, kappa and per-class accuracy from a confusion matrix.

    Args:
        matrix: ``m[true, pred]`` counts.
        loss: the mean loss to carry along.

    Returns:
        The scores; OA, AA and kappa are zero for an empty matrix.
    """
    support = matrix.sum(axis=1)
    diag = np.diag(matrix).astype(np.float64)
    pairs = zip(diag.tolist(), support.tolist(), strict=True)
    accuracy = tuple(float(d / s) if s > 0 else None for d, s in pairs)
    counts = tuple(int(s) for s in support)
    confusion = tuple(tuple(int(v) for v in row) for row in matrix)
    total = matrix.sum()
    if total == 0:
        return Scores(0.0, 0.0, 0.0, loss, accuracy, counts, confusion)
    oa = diag.sum() / total
    present = support > 0
    aa = float(np.mean(diag[present] / support[present]))
    expected = float((matrix.sum(axis=0) * support).sum()) / float(total) ** 2
    kappa = (oa - expected) / (1.0 - expected) if expected < 1.0 else 1.0
    return Scores(float(oa), aa, float(kappa), float(loss), accuracy, counts, confusion)
