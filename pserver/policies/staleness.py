"""Staleness functions f(tau) that scale an async push's learning rate."""

from __future__ import annotations

import math
from collections.abc import Callable

from common.errors import ConfigError


def staleness_function(kind: str, a: float = 0.5, b: float = 4.0) -> Callable[[int], float]:
    """The learning-rate factor for a push computed ``tau`` versions ago.

    Args:
        kind: ``inverse`` 1/(tau+1); ``poly`` (tau+1)^-a; ``hinge`` 1 if tau <= b else
            1/(a(tau-b)+1) (FedAsync); ``exp`` e^(-a tau); ``constant`` 1.
        a: the decay parameter of ``poly``, ``hinge`` and ``exp``.
        b: the hinge point of ``hinge``.

    Returns:
        f with f(0) == 1 and f non-increasing in tau.

    Raises:
        ConfigError: unknown kind.
    """
    if kind == "inverse":
        return lambda tau: 1.0 / (tau + 1)
    if kind == "poly":
        return lambda tau: (tau + 1) ** -a
    if kind == "hinge":
        return lambda tau: 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1)
    if kind == "exp":
        return lambda tau: math.exp(-a * tau)
    if kind == "constant":
        return lambda tau: 1.0
    raise ConfigError(f"unknown staleness function {kind!r}")


def too_stale(tau: int, limit: int | None) -> bool:
    """Whether a push ``tau`` versions old is refused under ``--max-staleness`` ``limit``
    (None: no bound); a refused worker re-pulls and recomputes the same samples."""
    return limit is not None and tau > limit


def lr_scale(f: Callable[[int], float], tau: int, size: int, global_batch: int) -> float:
    """An async push's learning-rate factor: its share of a global batch times ``f(tau)``."""
    return size / global_batch * f(tau)
