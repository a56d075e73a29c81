"""One bounded wait for a condition that nothing announces (a file appearing, a process count)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from common.errors import WaitTimeout

T = TypeVar("T")


def poll_until(
    predicate: Callable[[], T | None],
    timeout: float,
    interval: float = 0.2,
    what: str = "the condition",
) -> T:
    """Call ``predicate`` until it returns a truthy value, at most for ``timeout`` seconds.

    The predicate is called at once, then every ``interval`` seconds, and once more at the
    deadline; it may raise to give up early (e.g. when the process it waits for has exited).

    Args:
        predicate: what is waited for; its first truthy result is returned.
        timeout: seconds to wait at most.
        interval: seconds between calls.
        what: what is waited for, for the error message (e.g. "the server's start event").

    Returns:
        The predicate's first truthy result.

    Raises:
        WaitTimeout: the predicate stayed falsy for ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(min(interval, left))
