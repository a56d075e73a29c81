"""Speed measurement: samples per second of compute, followed robustly, slowdown emulation
included."""

from __future__ import annotations

import math

from common.training.perfmodel import CHANGE_Z, HUBER_K, MIN_NOISE, Shift, log_ratio

SIGMA_SMOOTHING = 0.1  # weight of the newest absolute log ratio in the sigma


class SpeedMeter:
    """Samples per second of compute, smoothed in log space, with the performance model's
    change points (``Shift``): a step moves the speed by ``smoothing`` times its ``log_ratio``
    to the time the speed predicts, clipped at ``HUBER_K`` sigmas (a stall barely moves it);
    a change point sets it to the new level. The sigma follows sqrt(pi / 2) x the absolute
    ratios within ``CHANGE_Z`` sigmas (``SIGMA_SMOOTHING``), at least ``MIN_NOISE``.

    Only compute counts (forward, backward and the emulated slowdown), never time spent
    waiting for data, replies or other workers.

    Args:
        smoothing: weight of the newest measurement, in (0, 1].
    """

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing, self.speed, self.shift = smoothing, 0.0, Shift()
        self.shift.sigma = MIN_NOISE

    def update(self, samples: int, seconds: float) -> float:
        """Add one measurement and return the speed."""
        seconds = max(seconds, 1e-9)
        if not self.speed:
            self.speed = samples / seconds
            return self.speed
        predicted = samples / self.speed
        factor = self.shift.add(seconds, predicted)
        if factor is None:
            sigma, ratio = self.shift.sigma, log_ratio(seconds, predicted)  # > 0: slower
            factor = math.exp(self.smoothing * max(-HUBER_K * sigma, min(ratio, HUBER_K * sigma)))
            if abs(ratio) <= CHANGE_Z * sigma:  # beyond: an outlier, or a change under way
                spread = math.sqrt(math.pi / 2) * abs(ratio) - sigma
                self.shift.sigma = max(MIN_NOISE, sigma + SIGMA_SMOOTHING * spread)
        self.speed /= factor
        return self.speed
