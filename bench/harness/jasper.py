"""Jasper Ridge as the benches use it: patches with a random stratified split (seed 0),
prepared once per output folder."""

from __future__ import annotations

from pathlib import Path

from common.data import JASPER_DIR, JASPER_FILES
from common.data.convert.hsi import prepare_hsi


def jasper_missing(jasper_dir: Path = JASPER_DIR) -> str | None:
    """Why Jasper Ridge cannot be prepared from ``jasper_dir`` (None: its files are there)."""
    missing = [name for name in JASPER_FILES if not (jasper_dir / name).is_file()]
    return f"Jasper Ridge not found in {jasper_dir}: no {', '.join(missing)}" if missing else None


def jasper(
    out: Path, patch: int = 5, train_fraction: float = 0.1, jasper_dir: Path = JASPER_DIR
) -> Path:
    """``out/jasper_p<patch>_tf<percent>.h5``, prepared from ``jasper_dir`` unless it is there."""
    path = out / f"jasper_p{patch}_tf{round(100 * train_fraction)}.h5"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        prepare_hsi(
            str(jasper_dir / "JasperRidge.mat"),
            str(jasper_dir / "JasperRidge_gt.mat"),
            path,
            patch=patch,
            train_fraction=train_fraction,
            split="random",
            seed=0,
        )
    return path
