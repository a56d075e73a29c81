"""The event loop a server runs on: uvloop's when it is installed, else asyncio's own."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

ENV = "PSERVER_EVENT_LOOP"  # "asyncio" runs on the standard loop even where uvloop is installed
T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` when uvloop is installed and ``PSERVER_EVENT_LOOP`` is not
    ``asyncio``; None (the standard loop) otherwise."""
    if os.environ.get(ENV, "") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a new loop of ``loop_factory``'s kind (as ``asyncio.run``).

    Returns:
        What ``main`` returned.
    """
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
