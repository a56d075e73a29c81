"""Jasper Ridge in its distributed layout: the preconverted samples, and training like the
preconverted file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.io

from common.data.convert.hsi import prepare_hsi
from common.data.convert.matfile import load_class_names, load_mat_array
from common.data.dataset import DatasetReader
from tests.support.scenes import abundances_for, to_matrix


def distributed_jasper(jasper_dir: Path, out: Path, crop: int | None = None) -> tuple[Path, Path]:
    """Write Jasper Ridge as the benchmark ships it: ``Y`` (Jasper) or ``V`` (Samson, cropped).

    Returns:
        ``(scene.mat, abundances.mat)``.
    """
    cube = load_mat_array(str(jasper_dir / "JasperRidge.mat"))
    gt = load_mat_array(str(jasper_dir / "JasperRidge_gt.mat:jasper_ridge_gt"))
    names = load_class_names(jasper_dir / "JasperRidge_gt.mat")
    assert names is not None
    if crop is not None:  # Samson's shape: 95 x 95 pixels, 156 bands
        cube, gt = cube[:crop, :crop, :156], gt[:crop, :crop]
    rows, cols, bands = cube.shape
    key = "V" if crop is not None else "Y"
    scene, ends = out / f"{key}_R{bands}.mat", out / f"end{len(names)}.mat"
    scipy.io.savemat(
        scene,
        {
            key: to_matrix(cube).astype(np.float64),
            "nRow": float(rows),
            "nCol": float(cols),
            "nBand": float(bands),
            "maxValue": float(cube.max()),
            "SlectBands": np.arange(1, bands + 1, dtype=np.float64)[:, None],
        },
    )
    scipy.io.savemat(
        ends,
        {
            "A": abundances_for(gt.astype(np.int64), len(names)),
            "M": np.ones((bands, len(names))),
            "cood": np.array(names, dtype=object),
        },
    )
    return scene, ends


@pytest.mark.realdata
@pytest.mark.parametrize("crop", [None, 95], ids=["jasper-Y", "samson-V-95x95x156"])
def test_distributed_jasper_gives_the_preconverted_samples(
    jasper_dir: Path, tmp_path: Path, crop: int | None
) -> None:
    scene, ends = distributed_jasper(jasper_dir, tmp_path, crop)
    cube = load_mat_array(str(jasper_dir / "JasperRidge.mat"))
    gt = load_mat_array(str(jasper_dir / "JasperRidge_gt.mat:jasper_ridge_gt"))
    if crop is not None:
        cube, gt = cube[:crop, :crop, :156], gt[:crop, :crop]
    scipy.io.savemat(tmp_path / "cube.mat", {"cube": cube})
    scipy.io.savemat(
        tmp_path / "gt.mat", {"gt": gt, "class_names": ["tree", "water", "dirt", "road"]}
    )
    ref = prepare_hsi(str(tmp_path / "cube.mat"), str(tmp_path / "gt.mat"), tmp_path / "ref.h5")
    got = prepare_hsi(str(scene), str(ends), tmp_path / "dist.h5", gt_abundance=True)
    assert got.class_names == ref.class_names == ("tree", "water", "dirt", "road")
    assert got.class_counts == ref.class_counts and got.num_samples == ref.num_samples
    with DatasetReader(ref.path) as a, DatasetReader(got.path) as b:
        np.testing.assert_array_equal(a.train_indices, b.train_indices)
        xa, ya = a.read(np.arange(a.meta.num_samples))
        xb, yb = b.read(np.arange(b.meta.num_samples))
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_allclose(xa, xb, atol=1e-5)


@pytest.mark.realdata
def test_distributed_jasper_trains_like_the_preconverted_file(
    jasper_dir: Path, jasper_h5: Path, tmp_path: Path
) -> None:
    from tests.support.runs import train

    scene, ends = distributed_jasper(jasper_dir, tmp_path)
    dist = prepare_hsi(str(scene), str(ends), tmp_path / "dist.h5", gt_abundance=True)
    ref = train(jasper_h5, tmp_path / "ref", "hsi-cnn", epochs=1, workers=1)
    got = train(Path(dist.path), tmp_path / "dist", "hsi-cnn", epochs=1, workers=1)
    assert ref["final"]["oa"] > 0.7
    assert abs(got["final"]["oa"] - ref["final"]["oa"]) <= 0.02, (got["final"], ref["final"])
