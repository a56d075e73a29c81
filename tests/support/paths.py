"""Where the tests find the repository and the shared real data."""

from __future__ import annotations

from pathlib import Path

from common.data import JASPER_DIR, JASPER_FILES

__all__ = ["JASPER_DIR", "JASPER_FILES", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]
