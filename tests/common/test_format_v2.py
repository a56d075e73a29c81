"""Dataset format 2: samples in their stored dtype (raw integers normalised on read, or
float16), format-1 files still load, fingerprints cover the stored bytes."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from common.data.codec import SampleCodec, encode
from common.data.dataset import DatasetReader
from common.errors import DatasetError
from tests.support.datasets import SHAPE, raw_samples, write_dataset


def test_raw_uint16_is_stored_as_is_and_normalised_on_read(tmp_path: Path) -> None:
    x, y = raw_samples()
    mean = x.astype(np.float64).mean(axis=(0, 2, 3))
    std = x.astype(np.float64).std(axis=(0, 2, 3))
    out = tmp_path / "raw.h5"
    write_dataset(out, x, y, "uint16", norm_mean=mean, norm_std=std)
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
    x, y = raw_samples()
    out = tmp_path / "raw.h5"
    write_dataset(out, x, y, "uint16", norm_mean=np.full(3, 100.0), norm_std=np.full(3, 7.0))
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
    full = write_dataset(tmp_path / "f32.h5", x, y, "float32")
    half = write_dataset(tmp_path / "f16.h5", x, y, "float16")
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
    fingerprint = write_dataset(out, x, y, "float32", norm_mean=np.zeros(3), norm_std=np.ones(3))
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
    x, y = raw_samples()
    with pytest.raises(DatasetError, match="need norm_mean and norm_std"):
        write_dataset(tmp_path / "r.h5", x, y, "uint16")
    with pytest.raises(DatasetError, match="finite and > 0"):
        write_dataset(
            tmp_path / "r.h5", x, y, "uint16", norm_mean=np.zeros(3), norm_std=np.zeros(3)
        )
    with pytest.raises(DatasetError, match="not one of"):
        write_dataset(tmp_path / "r.h5", x, y, "float64")
    assert not (tmp_path / "r.h5").exists()


def test_raw_samples_without_their_statistics_are_refused_on_open(tmp_path: Path) -> None:
    x, y = raw_samples()
    out = tmp_path / "raw.h5"
    write_dataset(out, x, y, "uint16", norm_mean=np.zeros(3), norm_std=np.ones(3))
    with h5py.File(out, "a") as f:
        del f["norm_std"]
    with pytest.raises(DatasetError, match="norm_std is missing"):
        DatasetReader(out)
