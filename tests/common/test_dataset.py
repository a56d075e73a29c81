"""Tests of the HDF5 dataset format: writer, reader, fingerprint, describe and the info CLI."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from common.data.dataset import DatasetReader, describe
from common.data.splits import stratified_split
from common.data.writer import DatasetWriter
from common.errors import DatasetError
from pserver.cli.data_cli import data_group

SHAPE = (3, 4, 4)


def make_data(n: int = 50, k: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *SHAPE)).astype(np.float32)
    y = np.arange(n) % k
    return x, y


def write_file(
    path: Path, x: np.ndarray, y: np.ndarray, block: int = 7, k: int = 3, **close_kw
) -> str:
    train, test = stratified_split(y, 0.3, seed=0, num_classes=k)
    names = [f"c{i}" for i in range(k)]
    with DatasetWriter(
        path, SHAPE, num_samples=len(y), kind="scenes", class_names=names, source="unit test"
    ) as w:
        for s in range(0, len(y), block):
            w.write(x[s : s + block], y[s : s + block])
        return w.close(train, test, **close_kw)


def test_round_trip_layout_and_meta(tmp_path: Path) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    fp = write_file(out, x, y, extra_attrs={"patch": 4, "note": {"a": 1}})
    with h5py.File(out, "r") as f:
        assert f["x"].dtype == np.float32 and f["x"].chunks == (1, *SHAPE)
        assert f["y"].dtype == np.int64
        assert f.attrs["format_version"] == 2 and f.attrs["normalise_on_read"] == 0
        assert json.loads(f.attrs["class_names"]) == ["c0", "c1", "c2"]
        assert f.attrs["fingerprint"] == fp
    with DatasetReader(out) as r:
        m = r.meta
        assert m.shape == SHAPE and m.num_samples == 50 and m.num_classes == 3
        assert m.kind == "scenes" and m.class_names == ("c0", "c1", "c2")
        assert m.train_count + m.test_count == 50
        assert m.source == "unit test" and m.attrs["patch"] == 4
        assert json.loads(m.attrs["note"]) == {"a": 1}
        assert sum(m.class_counts["train"]) == m.train_count
        xa, ya = r.read(np.arange(50))
        np.testing.assert_array_equal(xa, x)
        np.testing.assert_array_equal(ya, y)
        assert r.verify()
        with pytest.raises(ValueError):
            r.train_indices[0] = 1  # shared, read-only arrays
    assert not list(tmp_path.glob("*.tmp")), "temporary file left behind"


def test_fingerprint_independent_of_block_size_and_sensitive_to_data(tmp_path: Path) -> None:
    x, y = make_data()
    a = write_file(tmp_path / "a.h5", x, y, block=7)
    b = write_file(tmp_path / "b.h5", x, y, block=50)
    assert a == b and len(a) == 64
    x2 = x.copy()
    x2[10, 0, 0, 0] += 1e-3
    assert write_file(tmp_path / "c.h5", x2, y) != a


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0])
def test_read_order_duplicates_and_blocks(tmp_path: Path, cache_bytes: int) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    write_file(out, x, y)
    idx = np.array([7, 3, 3, 49, 0, 7])
    with DatasetReader(out, cache_bytes=cache_bytes) as r:
        xs, ys = r.read(idx)
        np.testing.assert_array_equal(xs, x[idx])
        np.testing.assert_array_equal(ys, y[idx])
        assert xs.dtype == np.float32 and ys.dtype == np.int64
        assert r.read([])[0].shape == (0, *SHAPE)
        blocks = list(r.iter_blocks(r.test_indices, block=8))
        assert [len(b[1]) for b in blocks][:-1] == [8] * (len(blocks) - 1)
        np.testing.assert_array_equal(np.concatenate([b[0] for b in blocks]), x[r.test_indices])
        with pytest.raises(DatasetError, match="index 50 outside"):
            r.read([1, 50])
    with pytest.raises(DatasetError, match="closed"):
        r.read([1])


@pytest.mark.parametrize("layout", [{"compression": "gzip", "chunks": (1, *SHAPE)}, {}])
def test_read_other_layouts(tmp_path: Path, layout: dict) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    write_file(out, x, y)
    with h5py.File(out, "a") as f:  # e.g. a file rewritten by another tool
        del f["x"]
        f.create_dataset("x", data=x, **layout)
    idx = np.array([9, 1, 2, 3, 3, 40, 0])
    with DatasetReader(out, cache_bytes=0) as r:
        np.testing.assert_array_equal(r.read(idx)[0], x[idx])
        assert r.verify()


def test_reader_usable_from_other_threads(tmp_path: Path) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    write_file(out, x, y)
    errors: list[BaseException] = []
    with DatasetReader(out, cache_bytes=0) as r:

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(20):
                    idx = rng.integers(0, 50, 10)
                    np.testing.assert_array_equal(r.read(idx)[0], x[idx])
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_stratified_split_covers_every_class_and_is_disjoint() -> None:
    y = np.array([0] * 100 + [1] * 10 + [2] * 2 + [3] * 1)
    train, test = stratified_split(y, 0.1, seed=3, num_classes=5)
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.union1d(train, test), np.arange(y.size))
    assert np.bincount(y[train], minlength=5).tolist() == [10, 1, 1, 1, 0]
    assert np.bincount(y[test], minlength=5).tolist() == [90, 9, 1, 0, 0]
    again = stratified_split(y, 0.1, seed=3, num_classes=5)
    np.testing.assert_array_equal(again[0], train)
    with pytest.raises(DatasetError, match=r"1\.5"):
        stratified_split(y, 1.5, seed=0)


def test_writer_errors_and_atomicity(tmp_path: Path) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    with pytest.raises(DatasetError, match="kind"):
        DatasetWriter(out, SHAPE, num_samples=10, kind="video", class_names=["a"])
    with (
        pytest.raises(DatasetError, match=r"shape \(2, 3, 3, 3\)"),
        DatasetWriter(out, SHAPE, num_samples=10, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(np.zeros((2, 3, 3, 3)), np.zeros(2, dtype=int))
    with (
        pytest.raises(DatasetError, match="label 5"),
        DatasetWriter(out, SHAPE, num_samples=10, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(x[:2], np.array([0, 5]))
    with (
        pytest.raises(DatasetError, match="NaN"),
        DatasetWriter(out, SHAPE, num_samples=2, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(np.full((2, *SHAPE), np.nan), np.array([0, 1]))
    with (
        pytest.raises(DatasetError, match="exceeds"),
        DatasetWriter(out, SHAPE, num_samples=2, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(x[:3], y[:3])
    with (
        pytest.raises(DatasetError, match="only 2 of"),
        DatasetWriter(out, SHAPE, num_samples=4, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(x[:2], y[:2])
        w.close([0], [1])
    with (
        pytest.raises(DatasetError, match="share 1 indices"),
        DatasetWriter(out, SHAPE, num_samples=2, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(x[:2], y[:2])
        w.close([0, 1], [1])
    with (
        pytest.raises(DatasetError, match="without close"),
        DatasetWriter(out, SHAPE, num_samples=2, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(x[:2], y[:2])
    with (
        pytest.raises(RuntimeError),
        DatasetWriter(out, SHAPE, num_samples=2, kind="hsi", class_names=["a"]),
    ):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == [], "failed writes must leave no file"


def test_failed_rewrite_keeps_the_old_file(tmp_path: Path) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    fp = write_file(out, x, y)
    with (
        pytest.raises(DatasetError),
        DatasetWriter(out, SHAPE, num_samples=50, kind="hsi", class_names=["a", "b", "c"]) as w,
    ):
        w.write(x[:10], y[:10])
        w.close([0], [1])
    assert describe(out)["fingerprint"] == fp


def test_reader_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        DatasetReader(tmp_path / "nope.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(DatasetError, match=r"junk\.h5"):
        DatasetReader(junk)
    x, y = make_data()
    out = tmp_path / "d.h5"
    write_file(out, x, y)
    with h5py.File(out, "a") as f:
        del f["test_idx"]
    with pytest.raises(DatasetError, match=r"/test_idx is missing"):
        DatasetReader(out)
    write_file(out, x, y)
    with h5py.File(out, "a") as f:
        f.attrs["format_version"] = 7
    with pytest.raises(DatasetError, match="format_version is 7"):
        DatasetReader(out)
    write_file(out, x, y)
    with h5py.File(out, "a") as f:
        f["test_idx"][0] = f["train_idx"][0]
    with pytest.raises(DatasetError, match=r"d\.h5"):
        DatasetReader(out)


def _no_class_count(f: h5py.File) -> None:
    f.attrs["num_classes"] = "many"


def _looping_link(f: h5py.File) -> None:
    del f["train_idx"]
    f["train_idx"] = h5py.SoftLink("/train_idx")


def _dangling_split(f: h5py.File) -> None:
    del f["train_idx"]
    f["train_idx"] = h5py.ExternalLink("absent.h5", "/train_idx")


@pytest.mark.parametrize("damage", [_no_class_count, _looping_link, _dangling_split])
def test_reader_rejects_hostile_files_with_a_dataset_error(
    tmp_path: Path, damage: Callable[[h5py.File], None]
) -> None:
    """Attributes of another kind and links that lead in circles or nowhere are a
    DatasetError naming the file, never another exception."""
    out = tmp_path / "d.h5"
    x, y = make_data()
    write_file(out, x, y)
    with h5py.File(out, "a") as f:
        damage(f)
    with pytest.raises(DatasetError, match=r"d\.h5"):
        DatasetReader(out)


def test_describe_and_info_cli(tmp_path: Path) -> None:
    x, y = make_data()
    out = tmp_path / "d.h5"
    fp = write_file(out, x, y)
    info = describe(out)
    assert info["samples"] == 50 and info["classes"] == 3 and info["shape"] == list(SHAPE)
    assert info["counts"]["train"] + info["counts"]["test"] == 50
    assert sum(info["counts"]["per_class"]["test"]) == info["counts"]["test"]
    assert info["fingerprint"] == fp and info["kind"] == "scenes"
    json.dumps(info)
    runner = CliRunner()
    res = runner.invoke(data_group, ["info", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == info
    res = runner.invoke(data_group, ["info", str(out)])
    assert res.exit_code == 0 and "samples:     50" in res.output and "c2" in res.output
    res = runner.invoke(data_group, ["info", str(tmp_path / "missing.h5")])
    assert res.exit_code == 1 and "missing.h5" in res.output
