"""``data prepare torch``: a Dataset class written here converts and trains; images to a CSV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from common.data.convert.torch_dataset import parse_kwargs, prepare_torch
from common.errors import DatasetError
from tests.support.user_dataset import importable_user_module


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module ``user_stripes_<n>`` importable in this process."""
    yield from importable_user_module(tmp_path, monkeypatch)


def test_parse_kwargs() -> None:
    assert parse_kwargs("n=12,name=abc,flag=True,scale=0.5,none=None,s='x y'") == {
        "n": 12,
        "name": "abc",
        "flag": True,
        "scale": 0.5,
        "none": None,
        "s": "x y",
    }
    assert parse_kwargs(None) == {} and parse_kwargs("") == {}
    with pytest.raises(DatasetError, match="NAME=VALUE"):
        parse_kwargs("justaword")


def test_converts_dicts_and_tuples_alike(user_module: str, tmp_path: Path) -> None:
    a = prepare_torch(f"{user_module}:Stripes", tmp_path / "a.h5", {"n": 60}, progress=False)
    assert a.class_names == ("horizontal", "vertical", "plain")
    assert a.shape == (3, 16, 16) and a.num_samples == 60 and a.kind == "scenes"
    b = prepare_torch(
        f"{user_module}:Tuples", tmp_path / "b.h5", {"n": 60}, ["h", "v", "p"], progress=False
    )
    assert b.fingerprint == a.fingerprint and b.class_names == ("h", "v", "p")
    c = prepare_torch(f"{user_module}:Tuples", tmp_path / "c.h5", {"n": 60}, progress=False)
    assert c.class_names == ("class_0", "class_1", "class_2")
    # Stratified split, normalisation from the training samples only.
    with h5py.File(tmp_path / "a.h5", "r") as f:
        x, y, train_idx = f["x"][...], f["y"][...], f["train_idx"][...]
        mean, std = f["norm_mean"][...], f["norm_std"][...]
    per_class = np.bincount(y, minlength=3)
    assert np.all(np.abs(np.bincount(y[train_idx], minlength=3) - 0.8 * per_class) <= 1)
    train = x[train_idx].transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(train.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=1), 1.0, atol=1e-5)
    assert np.all(mean > 60) and np.all(std > 10)  # raw statistics stored


def test_conversion_errors(user_module: str, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="differs between two reads"):
        prepare_torch(f"{user_module}:Jittery", tmp_path / "j.h5", {"n": 20}, progress=False)
    with pytest.raises(DatasetError, match="segmentation mask is not a class label"):
        prepare_torch(f"{user_module}:Masks", tmp_path / "m.h5", {"n": 20}, progress=False)
    with pytest.raises(DatasetError, match="cannot import"):
        prepare_torch(f"{user_module}:Nope", tmp_path / "n.h5", progress=False)
    with pytest.raises(DatasetError, match="failed: TypeError"):
        prepare_torch(f"{user_module}:Stripes", tmp_path / "n.h5", {"bogus": 1}, progress=False)
    with pytest.raises(DatasetError, match="labels run from 0 to 2 but there are 2 class names"):
        prepare_torch(
            f"{user_module}:Tuples", tmp_path / "n.h5", {"n": 30}, ["a", "b"], progress=False
        )
    assert not list(tmp_path.glob("*.h5"))
