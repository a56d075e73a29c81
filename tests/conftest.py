"""Shared pytest fixtures: the real Jasper Ridge data (skipped or failed when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

JASPER_DIR = Path(__file__).resolve().parents[2] / "shared/datasets/jasper_ridge"
JASPER_FILES = ("JasperRidge.mat", "JasperRidge_gt.mat")


@pytest.fixture(scope="session")
def jasper_dir() -> Path:
    """The Jasper Ridge folder; skips the test when it is absent, fails if REQUIRE_REAL_DATA=1."""
    missing = [name for name in JASPER_FILES if not (JASPER_DIR / name).is_file()]
    if not missing:
        return JASPER_DIR
    reason = f"real data missing: {', '.join(missing)} not found in {JASPER_DIR}"
    if os.environ.get("REQUIRE_REAL_DATA") == "1":
        pytest.fail(f"{reason} (REQUIRE_REAL_DATA=1 requires it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def jasper_h5(jasper_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Jasper Ridge prepared once per session: 5x5 patches, 10 % train, random split, seed 0."""
    from common.data.convert.hsi import prepare_hsi

    out = tmp_path_factory.mktemp("jasper") / "jasper_p5.h5"
    prepare_hsi(
        str(jasper_dir / "JasperRidge.mat"),
        str(jasper_dir / "JasperRidge_gt.mat"),
        out,
        patch=5,
        train_fraction=0.1,
        split="random",
        seed=0,
    )
    return out


@pytest.fixture(scope="session")
def small_hsi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic hyperspectral dataset (16 bands, 24x24 scene, 30 % train)."""
    from common.data.convert.synth import synth_hsi

    out = tmp_path_factory.mktemp("synth") / "small_hsi.h5"
    synth_hsi(out, bands=16, size=24, classes=4, train_fraction=0.3, seed=1)
    return out
