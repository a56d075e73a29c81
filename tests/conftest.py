"""Shared pytest set-up: the ``--require`` option, the ``unit``/``e2e`` markers (from where a
test lives: ``tests/e2e/`` holds every test that starts processes), and fixtures for real Jasper
Ridge data, small synthetic data, the Slurm testbed and network namespaces (skipped when
absent, failed when required)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support import requirements
from tests.support.paths import JASPER_DIR, JASPER_FILES

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_addoption(parser: pytest.Parser) -> None:
    requirements.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    requirements.configure(config)


@pytest.fixture(autouse=True)
def _children_take_sigint() -> None:
    """Tests interrupt servers and workers with SIGINT (Ctrl-C), and children inherit an
    ignored or blocked SIGINT (a suite run as a background job of a script starts with it
    ignored; code under test may block it for a while): each test starts with the default."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test ``e2e`` (under tests/e2e/) or ``unit`` (everywhere else)."""
    misplaced = []
    for item in items:
        if item.path.resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
        elif item.get_closest_marker("e2e") is not None:
            misplaced.append(item.nodeid)
        else:
            item.add_marker(pytest.mark.unit)
    if misplaced:
        raise pytest.UsageError(
            f"tests marked e2e outside {E2E_DIR}: {', '.join(misplaced)}; move them there"
        )


@pytest.fixture(scope="session")
def jasper_dir(pytestconfig: pytest.Config) -> Path:
    """The Jasper Ridge folder; skips the test when it is absent, fails under --require data."""
    missing = [name for name in JASPER_FILES if not (JASPER_DIR / name).is_file()]
    if missing:
        requirements.missing(
            pytestconfig,
            "data",
            f"real data missing: {', '.join(missing)} not found in {JASPER_DIR}",
        )
    return JASPER_DIR


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


@pytest.fixture(scope="session")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CURVE key pairs as ``pserver keygen`` makes them, plus ``stranger_secret``: a valid
    worker key that was never authorized."""
    from common.protocol.security import generate

    root = tmp_path_factory.mktemp("keys")
    made = generate(root / "cluster")
    stranger = generate(root / "stranger")
    made["stranger_secret"] = stranger["worker_secret"]
    return made


@pytest.fixture
def netns_ok(pytestconfig: pytest.Config) -> None:
    """Skips without root or iproute2; fails instead under --require netns."""
    from launch.cluster.netns import available

    reason = available()
    if reason is not None:
        requirements.missing(pytestconfig, "netns", reason)


@pytest.fixture(scope="session")
def slurm_testbed(pytestconfig: pytest.Config) -> None:
    """The project's Slurm testbed, started beforehand by ``make slurm-testbed``; skips when it
    is not up, fails under --require slurm."""
    from tests.support.slurm_jobs import testbed_problem

    reason = testbed_problem()
    if reason is not None:
        requirements.missing(pytestconfig, "slurm", reason)
