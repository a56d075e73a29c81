"""Emulated heterogeneity: a device F times slower waits (F-1)·t after t seconds of compute.

Shared by parameter-server workers and DDP ranks so both follow the same rule. Only compute
time counts: time spent communicating or waiting on other processes is never scaled, since in
DDP the backward pass contains the all-reduce and scaling it would feed back without bound.
Nor is time preempted by other processes: workers measure t as CPU time (``ComputeTimer``).
"""

from __future__ import annotations

import bisect
import time

from common.config import need
from common.errors import ConfigError


class SlowdownSchedule:
    """The slowdown factor as a function of the local step.

    Args:
        initial: factor from step 0 (>= 1).
        changes: ``"STEP:F,STEP:F"``: from local step STEP on, the factor is F.

    Raises:
        ConfigError: a malformed entry or a factor below 1.
    """

    def __init__(self, initial: float = 1.0, changes: str = "") -> None:
        points: list[tuple[int, float]] = [(0, float(initial))]
        for entry in filter(None, (e.strip() for e in changes.split(","))):
            step, sep, factor = entry.partition(":")
            try:
                points.append((int(step), float(factor)))
            except ValueError:
                raise ConfigError(
                    f"slowdown change {entry!r} is not STEP:FACTOR (e.g. 200:3)"
                ) from None
            need(sep, f"slowdown change {entry!r} is not STEP:FACTOR (e.g. 200:3)")
        points.sort(key=lambda point: point[0])  # stable: a later entry for a step wins
        if any(f < 1 for _, f in points):
            raise ConfigError(f"slowdown factors must be >= 1, got {[f for _, f in points]}")
        self._steps = [s for s, _ in points]
        self._factors = [f for _, f in points]

    @property
    def slows(self) -> bool:
        """Whether any factor is above 1 (else nothing is ever slept)."""
        return max(self._factors) > 1

    def factor(self, step: int) -> float:
        """The factor in force at local step ``step``."""
        return self._factors[bisect.bisect_right(self._steps, step) - 1]

    def emulate(self, step: int, wall_s: float, compute_s: float) -> float:
        """Sleep (F-1)·compute_s for this step's factor F, after a step of ``wall_s``.

        Returns:
            The emulated step time wall_s + (F-1)·compute_s.
        """
        wait = self.wait_s(step, compute_s)
        if wait > 0:
            time.sleep(wait)
        return wall_s + wait

    def wait_s(self, step: int, basis_s: float) -> float:
        """(F-1)·basis_s for this step's factor F (basis_s: a compute time), without sleeping."""
        return (self.factor(step) - 1) * basis_s
