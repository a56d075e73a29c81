"""Jasper Ridge as the benches use it: patches with a random stratified split (seed 0),
prepared once per output folder."""

from __future__ import annotations

from pathlib import Path

from common.data.convert.hsi import prepare_hsi

JASPER_DIR = Path(__file__).resolve().parents[2] / "shared/datasets/jasper_ridge"


def jasper(
    out: Path, patch: int = 5, train_fraction: float = 0.1, jasper_dir: Path = JASPER_DIR
) -> Path:
    """``out/jasper_p<patch>_tf<percent>.h5``, prepared from ``jasper_dir`` unless it is there."""
    path = out / f"jasper_p{patch}_tf{round(100 * train_fraction)}.h5"
    if not path.exists():
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
