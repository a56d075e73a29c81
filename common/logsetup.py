"""Logging set-up shared by the command-line programs."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO", prefix: str = "") -> None:
    """Log to stderr with a time stamp and an optional process prefix."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
