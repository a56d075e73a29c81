"""Rate-limited logging, so that a flood of bad messages cannot flood the log."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most ``burst`` records per key in each ``window_s``; the rest are counted and
    reported once the window ends.

    Args:
        logger: where records go.
        burst: records per key and window.
        window_s: window length in seconds.
    """

    def __init__(self, logger: logging.Logger, burst: int = 10, *, window_s: float = 10.0) -> None:
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self._windows: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        """Log a warning unless ``key`` already used up its burst in this window."""
        now = time.monotonic()
        start, count = self._windows.get(key, (now, 0))
        if now - start >= self.window_s:
            if count > self.burst:
                self.logger.warning("%d more %s warnings were suppressed", count - self.burst, key)
            start, count = now, 0
        count += 1
        self._windows[key] = (start, count)
        if count <= self.burst:
            self.logger.warning(msg, *args)
