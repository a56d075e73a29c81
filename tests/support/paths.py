"""Where the tests find the repository and the shared real data."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JASPER_DIR = ROOT.parent / "shared/datasets/jasper_ridge"
