"""Dataset format 2: samples in their stored dtype (raw integers normalised on read, or
float16), format-1 files still load, fingerprints cover the stored bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.data.codec import SampleCodec, encode
from common.data.dataset import DatasetReader
from common.data.splits import stratified_split
from common.data.writer import DatasetWriter
from common.errors import DatasetError

SHAPE = (3, 4, 4)


def _raw(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 60000, size=(n, *SHAPE)).astype(np.uint16)
    return x, np.arange(n) % 3


def _write(path: Path, x: np.ndarray, y: np.ndarray, x_dtype: str, **close: object) -> str:
    train, test = stratified_split(y, 0.5, seed=0, num_classes=3)
    with DatasetWriter(path, SHAPE, len(y), "scenes", ["a", "b", "c"], x_dtype=x_dtype) as w:
        w.write(x[:17], y[:17])
        w.write(x[17:], y[17:])
        return w.close(train, test, **close)  # type: ignore[arg-type]


def test_raw_uint16_is_stored_as_is_and_normalised_on_read(tmp_path: Path) -> None:
    x, y = _raw()
    mean = x.astype(np.float64).mean(axis=(0, 2, 3))
    std = x.astype(np.float64).std(axis=(0, 2, 3))
    out = tmp_path / "raw.h5"
    _write(out, x, y, "uint16", norm_mean=mean, norm_std=std)
    with h5py.File(out, "r") as f:
        assert f["x"].dtype == np.uint16 and f.attrs["normalise_on_read"] == 1
    with DatasetReader(out) as reader:
        stored, labels = reader.read_stored([5, 0, 5])
        assert stored.dtype == np.uint16
        np.testing.assert_array_equal(stored, x[[5, 0, 5]])
        model_input, _ = reader.read([5, 0, 5])
        expected = (x[[5, 0, 5]] - mean[:, None, None]) / std[:, None, None]
        np.testing.assert_allclose(model_input, expected, rtol=1e-5, atol=1e-5)
        assert model_input.dtype == np.float32
        np.testing.assert_array_equal(labels, y[[5, 0, 5]])
        assert reader.codec.raw and reader.verify()
        np.testing.assert_allclose(reader.codec.decode(stored), model_input)


def test_file_reads_agree_with_the_cached_reads(tmp_path: Path) -> None:
    x, y = _raw()
    out = tmp_path / "raw.h5"
    _write(out, x, y, "uint16", norm_mean=np.full(3, 100.0), norm_std=np.full(3, 7.0))
    with DatasetReader(out, cache_bytes=0) as direct, DatasetReader(out) as cached:
        rows = [39, 2, 2, 11]
        np.testing.assert_array_equal(direct.read_stored(rows)[0], cached.read_stored(rows)[0])
        np.testing.assert_array_equal(direct.read(rows)[0], cached.read(rows)[0])


def test_float16_halves_the_bytes_and_keeps_the_fingerprint_of_what_is_stored(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, *SHAPE)).astype(np.float32)
    y = np.arange(40) % 3
    full = _write(tmp_path / "f32.h5", x, y, "float32")
    half = _write(tmp_path / "f16.h5", x, y, "float16")
    assert full != half  # the stored bytes differ, so the fingerprints do
    with DatasetReader(tmp_path / "f16.h5") as reader:
        assert reader.read_stored([0])[0].dtype == np.float16
        np.testing.assert_allclose(reader.read([0, 1])[0], x[:2], atol=2e-3)
        assert reader.verify() and not reader.codec.normalises


def test_a_format_1_file_still_loads(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, *SHAPE)).astype(np.float32)
    y = np.arange(40) % 3
    out = tmp_path / "v1.h5"
    fingerprint = _write(out, x, y, "float32", norm_mean=np.zeros(3), norm_std=np.ones(3))
    with h5py.File(out, "a") as f:  # what the first format wrote
        f.attrs["format_version"] = 1
        del f.attrs["normalise_on_read"]
    with DatasetReader(out) as reader:
        assert reader.meta.fingerprint == fingerprint and reader.verify()
        np.testing.assert_array_equal(reader.read([3])[0], x[[3]])
        assert reader.codec == SampleCodec("float32")
    with h5py.File(out, "a") as f:  # format 1 had no other dtype
        del f["x"]
        f.create_dataset("x", data=x.astype(np.float16), chunks=(1, *SHAPE))
    with pytest.raises(DatasetError, match=r"/x must be one of \('float32',\)"):
        DatasetReader(out)


def test_values_that_do_not_fit_the_stored_dtype_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="do not fit uint16"):
        encode(np.array([-1.0, 3.0]), "uint16")
    with pytest.raises(DatasetError, match="not integers"):
        encode(np.array([1.5]), "uint16")
    with pytest.raises(DatasetError, match="do not fit float16"):
        encode(np.array([1e6]), "float16")
    x, y = _raw()
    with pytest.raises(DatasetError, match="need norm_mean and norm_std"):
        _write(tmp_path / "r.h5", x, y, "uint16")
    with pytest.raises(DatasetError, match="finite and > 0"):
        _write(tmp_path / "r.h5", x, y, "uint16", norm_mean=np.zeros(3), norm_std=np.zeros(3))
    with pytest.raises(DatasetError, match="not one of"):
        _write(tmp_path / "r.h5", x, y, "float64")
    assert not (tmp_path / "r.h5").exists()


def test_raw_samples_without_their_statistics_are_refused_on_open(tmp_path: Path) -> None:
    x, y = _raw()
    out = tmp_path / "raw.h5"
    _write(out, x, y, "uint16", norm_mean=np.zeros(3), norm_std=np.ones(3))
    with h5py.File(out, "a") as f:
        del f["norm_std"]
    with pytest.raises(DatasetError, match="norm_std is missing"):
        DatasetReader(out)


def test_statistics_of_another_band_count_are_refused_on_open(tmp_path: Path) -> None:
    """Else every worker fails on its first batch while the server waits for them."""
    x, y = _raw()
    out = tmp_path / "raw.h5"
    _write(out, x, y, "uint16", norm_mean=np.zeros(3), norm_std=np.ones(3))
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
    accuracy the float32 file gives (tests/test_e2e.py)."""
    from tests.cluster import start_server, start_worker, summary

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
