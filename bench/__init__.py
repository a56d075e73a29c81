"""Benchmarks of the project: ``python -m bench NAME`` runs one and records its result."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
