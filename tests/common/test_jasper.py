"""Real-data test: Jasper Ridge prepared into 5x5 patches with 10 % of each class for training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.data.convert.matfile import load_mat_array
from common.data.dataset import DatasetReader, describe

pytestmark = [pytest.mark.realdata, pytest.mark.slow]


def test_jasper_mat_files(jasper_dir: Path) -> None:
    cube = load_mat_array(str(jasper_dir / "JasperRidge.mat"))
    gt = load_mat_array(str(jasper_dir / "JasperRidge_gt.mat"))  # class_names is skipped
    assert cube.shape == (100, 100, 198) and gt.shape == (100, 100)
    assert np.bincount(gt.ravel()).tolist() == [361, 3412, 3310, 2256, 661]


def test_jasper_prepared(jasper_h5: Path) -> None:
    info = describe(jasper_h5)
    assert info["class_names"] == ["tree", "water", "dirt", "road"]
    assert info["classes"] == 4 and info["samples"] == 9639 and info["shape"] == [198, 5, 5]
    per_class = np.array([3412, 3310, 2256, 661])
    train = np.array(info["counts"]["per_class"]["train"])
    np.testing.assert_array_equal(train, np.round(0.1 * per_class))
    np.testing.assert_array_equal(train + info["counts"]["per_class"]["test"], per_class)
    assert info["attrs"]["patch"] == 5 and info["attrs"]["split"] == "random"
    with DatasetReader(jasper_h5) as r:
        assert np.intersect1d(r.train_indices, r.test_indices).size == 0
        x, _ = r.read(r.train_indices)
        assert x.shape == (964, 198, 5, 5) and np.isfinite(x).all()
        centre = x[:, :, 2, 2].astype(np.float64)
        np.testing.assert_allclose(centre.mean(0), 0.0, atol=1e-4)
        np.testing.assert_allclose(centre.std(0), 1.0, atol=1e-3)
