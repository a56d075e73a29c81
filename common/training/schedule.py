"""Learning-rate schedules over training, shared by the server and the DDP baseline."""

from __future__ import annotations

import math


def progress(
    steps: int, samples: int, train_count: int, max_steps: int | None, epochs: int | None
) -> float:
    """Fraction of training done, which drives the schedule: updates over ``max_steps`` when
    set, else samples applied over ``epochs`` of ``train_count`` samples (0 without a limit)."""
    if max_steps is not None:
        return steps / max_steps
    if epochs is not None:
        return samples / (epochs * train_count)
    return 0.0


def lr_factor(schedule: str, progress: float, warmup_fraction: float = 0.0) -> float:
    """The schedule's factor on the base learning rate.

    Args:
        schedule: ``constant``, ``cosine`` (to zero at the end) or ``step`` (x0.1 at 50 % and
            75 % of training).
        progress: fraction of training done, in [0, 1].
        warmup_fraction: linear warm-up over this first fraction of training.

    Returns:
        The factor in [0, 1].
    """
    progress = min(max(progress, 0.0), 1.0)
    if warmup_fraction > 0 and progress < warmup_fraction:
        return max(progress / warmup_fraction, 1e-3)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    return 1.0
