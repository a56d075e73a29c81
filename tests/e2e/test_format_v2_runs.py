"""Dataset format 2 with real data and processes: raw Jasper Ridge samples read like the float32
preparation and train a worker at half the bytes; a server refuses mismatched statistics in one
line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.data.dataset import DatasetReader
from common.errors import DatasetError
from tests.support.datasets import SHAPE, raw_samples, write_dataset


def test_statistics_of_another_band_count_are_refused_on_open(tmp_path: Path) -> None:
    """Else every worker fails on its first batch while the server waits for them."""
    x, y = raw_samples()
    out = tmp_path / "raw.h5"
    write_dataset(out, x, y, "uint16", norm_mean=np.zeros(3), norm_std=np.ones(3))
    with h5py.File(out, "a") as f:
        for name, value in (("norm_mean", 0.0), ("norm_std", 1.0)):
            del f[name]
            f[name] = np.full(SHAPE[0] + 1, value, dtype=np.float32)
    with pytest.raises(DatasetError, match="hold 4 bands' statistics, /x has 3 bands"):
        DatasetReader(out)
    args = ["start", "--dataset", str(out), "--model", "scene-cnn", "--epochs", "1"]
    started = subprocess.run(
        [sys.executable, "-m", "pserver.cli", *args, "--bind", "tcp://127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0 and "Traceback" not in started.stderr
    assert "/x has 3 bands" in started.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def jasper_raw(jasper_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Jasper Ridge as the fixture ``jasper_h5`` prepares it, but stored as raw uint16."""
    from common.data.convert.hsi import prepare_hsi

    out = tmp_path_factory.mktemp("jasper_raw") / "jasper_raw.h5"
    mat, gt = str(jasper_dir / "JasperRidge.mat"), str(jasper_dir / "JasperRidge_gt.mat")
    prepare_hsi(mat, gt, out, patch=5, train_fraction=0.1, seed=0, x_dtype="raw")
    return out


@pytest.mark.realdata
def test_jasper_raw_reads_like_the_float32_preparation(jasper_raw: Path, jasper_h5: Path) -> None:
    with DatasetReader(jasper_raw) as raw, DatasetReader(jasper_h5) as full:
        assert raw.codec.dtype == "uint16" and raw.codec.normalises
        assert raw.meta.fingerprint != full.meta.fingerprint
        np.testing.assert_array_equal(raw.train_indices, full.train_indices)
        rows = raw.train_indices[:64]
        np.testing.assert_allclose(raw.read(rows)[0], full.read(rows)[0], atol=1e-4)
        assert raw.read_stored(rows)[0].nbytes * 2 == full.read_stored(rows)[0].nbytes


@pytest.mark.realdata
def test_a_worker_trains_on_raw_samples_served_at_half_the_bytes(
    jasper_raw: Path, tmp_path: Path
) -> None:
    """The server sends uint16 samples, the worker normalises them: training reaches the
    accuracy the float32 file gives (tests/e2e/test_training.py)."""
    from tests.support.cluster import start_server, start_worker, summary

    server, address = start_server(
        jasper_raw, tmp_path, "--mode", "async", "--epochs", "6", "--workers", "1"
    )
    worker = start_worker(address, "w0")
    try:
        assert worker.wait(timeout=300) == 0
        assert server.wait(timeout=120) == 0
    finally:
        worker.kill()
        server.kill()
    result = summary(tmp_path)
    assert result["final"]["oa"] >= 0.85, result["final"]
