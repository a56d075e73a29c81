"""Shared pytest fixtures: real Jasper Ridge data, the Slurm testbed and network namespaces
(skipped when absent)."""

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


@pytest.fixture
def netns_ok() -> None:
    """Skips without root or iproute2; fails instead when REQUIRE_NETNS=1."""
    from launch.cluster.netns import available

    reason = available()
    if reason is None:
        return
    if os.environ.get("REQUIRE_NETNS") == "1":
        pytest.fail(f"{reason} (REQUIRE_NETNS=1 requires it)")
    pytest.skip(reason)


TESTBED = Path(__file__).resolve().parents[1] / "launch/slurm/testbed.sh"
TESTBED_MARK = "# rs-pserver Slurm testbed"


def _slurm_problem() -> str | None:
    """Why the project's Slurm testbed is not usable (None: it is up); starts it as root."""
    import shutil
    import subprocess

    conf = Path("/etc/slurm/slurm.conf")
    if conf.is_file() and not conf.read_text(encoding="utf-8").startswith(TESTBED_MARK):
        return f"{conf} belongs to another Slurm, not the project's testbed"
    if os.geteuid() != 0:
        if shutil.which("sinfo") is None:
            return "Slurm is not installed, and installing the testbed needs root"
        up = subprocess.run([str(TESTBED), "status"], capture_output=True, text=True, timeout=60)
        return None if up.returncode == 0 else "the Slurm testbed is down (start it as root)"
    try:
        done = subprocess.run(
            ["bash", str(TESTBED), "up"], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return "launch/slurm/testbed.sh up took more than 900 s"
    if done.returncode != 0:
        return f"launch/slurm/testbed.sh up failed: {done.stderr.strip()[-2000:]}"
    return None


@pytest.fixture(scope="session")
def slurm_testbed() -> None:
    """The project's Slurm testbed, started when needed; skips where it cannot run, fails
    when REQUIRE_SLURM=1."""
    reason = _slurm_problem()
    if reason is None:
        return
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"{reason} (REQUIRE_SLURM=1 requires Slurm)")
    pytest.skip(reason)
