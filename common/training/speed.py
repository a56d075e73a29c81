"""Speed measurement: samples per second of compute, smoothed, slowdown emulation included."""

from __future__ import annotations


class SpeedMeter:
    """An exponential moving average of samples per second of compute time.

    Only compute counts (forward, backward and the emulated slowdown), never time spent
    waiting for data, replies or other workers.

    Args:
        smoothing: weight of the newest measurement, in (0, 1].
    """

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing = smoothing
        self.speed = 0.0

    def update(self, samples: int, seconds: float) -> float:
        """Add one measurement and return the smoothed speed."""
        current = samples / max(seconds, 1e-9)
        if self.speed == 0.0:
            self.speed = current
        else:
            self.speed += self.smoothing * (current - self.speed)
        return self.speed
