"""Classification metrics on the test split: overall accuracy, average accuracy, Cohen's kappa."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Scores:
    """OA, AA (mean per-class recall over classes present), kappa and mean loss."""

    oa: float
    aa: float
    kappa: float
    loss: float


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts ``m[true, pred]`` as an int64 ``num_classes`` x ``num_classes`` matrix."""
    idx = y_true.astype(np.int64) * num_classes + y_pred.astype(np.int64)
    return np.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def scores_from_confusion(matrix: np.ndarray, loss: float) -> Scores:
    """OA, AA and kappa from a confusion matrix.

    Args:
        matrix: ``m[true, pred]`` counts.
        loss: the mean loss to carry along.

    Returns:
        The scores; all zero for an empty matrix.
    """
    total = matrix.sum()
    if total == 0:
        return Scores(0.0, 0.0, 0.0, loss)
    diag = np.diag(matrix).astype(np.float64)
    oa = diag.sum() / total
    support = matrix.sum(axis=1)
    present = support > 0
    aa = float(np.mean(diag[present] / support[present]))
    expected = float((matrix.sum(axis=0) * support).sum()) / float(total) ** 2
    kappa = (oa - expected) / (1.0 - expected) if expected < 1.0 else 1.0
    return Scores(float(oa), aa, float(kappa), float(loss))
