"""Splits keep their promise: realised per-class fractions beside the request, warnings else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.io
from click.testing import CliRunner

from common.data.convert.hsi import prepare_hsi
from common.data.split_report import (
    ClassSplit,
    class_splits,
    split_warnings,
    within_tolerance,
)
from common.data.splits import disjoint_split
from pserver.cli.data_cli import data_group


def landsat_like(rows: int = 60, cols: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """Three large classes in bands of columns and a small compact fourth class (6 x 6)."""
    rng = np.random.default_rng(3)
    gt = (np.arange(cols)[None, :] * 3 // cols + 1).repeat(rows, axis=0)
    gt[10:16, 30:36] = 4
    gt[:, :4] = 0  # an unlabelled strip
    cube = rng.normal(size=(rows, cols, 4)) + gt[..., None]
    return cube, gt.astype(np.uint8)


def save(tmp_path: Path, cube: np.ndarray, gt: np.ndarray) -> tuple[str, str]:
    names = np.array(["water", "crop", "forest", "urban"], dtype=object)
    scipy.io.savemat(tmp_path / "c.mat", {"cube": cube})
    scipy.io.savemat(tmp_path / "g.mat", {"gt": gt, "class_names": names})
    return str(tmp_path / "c.mat"), str(tmp_path / "g.mat")


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.3])
@pytest.mark.parametrize("patch", [3, 5, 7])
def test_disjoint_split_reaches_the_requested_fraction_or_warns(
    fraction: float, patch: int
) -> None:
    _, gt = landsat_like()
    coords = np.argwhere(gt > 0)
    y = gt[coords[:, 0], coords[:, 1]].astype(np.int64) - 1
    train, test = disjoint_split(coords, y, gt.shape, patch, fraction, seed=1)
    n = np.bincount(y, minlength=4)
    tr, te = np.bincount(y[train], minlength=4), np.bincount(y[test], minlength=4)
    rows = [ClassSplit(str(c), int(n[c]), int(tr[c]), int(te[c])) for c in range(4)]
    warnings = split_warnings(rows, fraction, patch, "disjoint")
    for row in rows:
        assert within_tolerance(fraction, row) or any(repr(row.name) in w for w in warnings)
    # The three large classes have room: their fraction is exact to a pixel.
    for row in rows[:3]:
        assert abs(row.train - round(fraction * row.labelled)) <= 0, row
    gap = np.abs(coords[test][:, None, :] - coords[train][None, :, :]).max(axis=-1)
    assert gap.min() >= patch


def test_tolerance_rule() -> None:
    assert within_tolerance(0.1, ClassSplit("a", 1000, 109, 800))
    assert not within_tolerance(0.1, ClassSplit("a", 1000, 111, 800))
    assert within_tolerance(0.1, ClassSplit("a", 7, 1, 6))  # 1/7 off 0.1 by < one pixel
    warned = split_warnings([ClassSplit("a", 1000, 280, 700)], 0.1, 5, "disjoint")
    assert len(warned) == 1 and "0.280 of its 1000 pixels train, 0.1 requested" in warned[0]


def test_prepare_cli_prints_realised_fractions_and_warns(tmp_path: Path) -> None:
    cube, gt = landsat_like()
    cube_spec, gt_spec = save(tmp_path, cube, gt)
    runner = CliRunner()
    args = ["prepare", "hsi", "--cube", cube_spec, "--gt", gt_spec, "--split", "disjoint"]
    fractions = {}
    for fraction in ("0.05", "0.1"):
        out = tmp_path / f"d{fraction}.h5"
        res = runner.invoke(data_group, [*args, "--train-fraction", fraction, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert f"disjoint split, train fraction {fraction} requested per class" in res.output
        meta = prepare_hsi(
            cube_spec,
            gt_spec,
            tmp_path / "again.h5",
            split="disjoint",
            train_fraction=float(fraction),
        )
        fractions[fraction] = [r.train_fraction for r in class_splits(meta)]
        water = next(line for line in res.output.splitlines() if line.strip().startswith("water"))
        assert water.split()[-1] == f"{fractions[fraction][0]:.3f}"
    assert fractions["0.05"] != fractions["0.1"]
    assert fractions["0.1"][0] == pytest.approx(0.1, abs=1e-3)
    # patch 7 and 0.3: the small urban block is all guard band around its training pixels
    out = tmp_path / "p7.h5"
    res = runner.invoke(
        data_group, [*args, "--train-fraction", "0.3", "--patch", "7", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    warning = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert any(
        "class 'urban' (" in w
        and "has no test samples" in w
        and "a smaller --patch or --train-fraction" in w
        for w in warning
    ), res.output
