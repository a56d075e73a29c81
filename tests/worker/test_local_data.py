"""Local dataset copies: reads match the reader, prefetching, and the fingerprint check."""

from __future__ import annotations

import re
import shutil
from contextlib import closing
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from common.data.convert.synth import synth_hsi
from common.data.dataset import DatasetReader
from common.errors import ConfigError, DatasetError
from worker.cli import main as worker_main
from worker.config import WorkerConfig
from worker.local_data import open_local_copy
from worker.prefetch import AheadReader


def _fingerprint(path: Path) -> str:
    with DatasetReader(path, cache_bytes=0) as reader:
        return reader.meta.fingerprint


@pytest.mark.parametrize("cache_bytes", [0, 1 << 30], ids=["from-file", "in-memory"])
def test_reads_match_the_dataset_reader(small_hsi: Path, cache_bytes: int) -> None:
    with DatasetReader(small_hsi, cache_bytes=0) as reference:
        train = reference.train_indices
        first = train[:16].tolist()
        second = [*train[::-3][:10].tolist(), int(train[0]), int(train[0])]
        expected = [reference.read(ix) for ix in (first, second, second)]
    with closing(
        open_local_copy(small_hsi, _fingerprint(small_hsi), cache_bytes=cache_bytes)
    ) as data:
        assert isinstance(data, AheadReader)
        data.start(first)
        got = [data.get(first)]  # the prefetched read
        data.start(second)
        got.append(data.get(second))
        got.append(data.get(second))  # not started: read now
        data.start([])  # the last task has nothing to prefetch
        for (x, y), (ex, ey) in zip(got, expected, strict=True):
            assert x.dtype == torch.float32 and y.dtype == torch.int64
            np.testing.assert_array_equal(x, ex)
            np.testing.assert_array_equal(y, ey)
        assert data.wait_s > 0


def test_a_prefetch_for_other_indices_is_not_returned(small_hsi: Path) -> None:
    with closing(open_local_copy(small_hsi, _fingerprint(small_hsi))) as data:
        data.start([0, 1, 2])
        x, y = data.get([5, 4])
        with DatasetReader(small_hsi) as reference:
            ex, ey = reference.read([5, 4])
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_read_errors_surface_in_get(small_hsi: Path) -> None:
    with closing(open_local_copy(small_hsi, _fingerprint(small_hsi))) as data:
        data.start([10**9])
        with pytest.raises(DatasetError, match="outside"):
            data.get([10**9])


def test_a_copy_with_other_data_is_refused(small_hsi: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    synth_hsi(other, bands=16, size=24, classes=4, train_fraction=0.3, seed=2)
    server_fp, other_fp = _fingerprint(small_hsi), _fingerprint(other)
    assert server_fp != other_fp
    with pytest.raises(DatasetError) as caught:
        open_local_copy(other, server_fp)
    message = str(caught.value)
    assert f"local copy {str(other)!r} has fingerprint {other_fp[:12]}…" in message
    assert f"the server's dataset has {server_fp[:12]}…" in message
    assert message.endswith("use the same file or drop --data")


def test_a_copy_is_accepted_and_verify_catches_edited_contents(
    small_hsi: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy.h5"
    shutil.copyfile(small_hsi, copy)
    fingerprint = _fingerprint(small_hsi)
    open_local_copy(copy, fingerprint, verify=True).close()
    with h5py.File(copy, "r+") as f:
        f["x"][0, 0, 0, 0] += 1.0  # the stored fingerprint attribute stays as it was
    open_local_copy(copy, fingerprint).close()  # the cheap check only reads the attribute
    with pytest.raises(DatasetError, match="does not match its own fingerprint"):
        open_local_copy(copy, fingerprint, verify=True)


def test_a_missing_copy_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        open_local_copy(tmp_path / "nope.h5", "0" * 64)


def test_worker_config_checks_the_data_path(small_hsi: Path, tmp_path: Path) -> None:
    base = {"server": "tcp://127.0.0.1:5555"}
    assert WorkerConfig(**base, data=str(small_hsi)).validate().data == str(small_hsi)
    missing = str(tmp_path / "missing.h5")
    with pytest.raises(ConfigError, match=re.escape(f"--data {missing!r} is not a file")):
        WorkerConfig(**base, data=missing).validate()
    with pytest.raises(ConfigError, match="is not a file"):
        WorkerConfig(**base, data=str(tmp_path)).validate()


def test_the_cli_documents_the_new_options() -> None:
    result = CliRunner().invoke(worker_main, ["join", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    blocks = re.split(r"\n(?=  -)", result.output)  # one block per option, wrapped lines joined
    for option in ("--data PATH", "--augment / --no-augment", "--augment-noise STD"):
        block = " ".join(next(b for b in blocks if b.lstrip().startswith(option)).split())
        assert "default:" in block and "env var: WORKER_JOIN_" in block, block
