"""Maps fit for a paper: palettes, agreement colours, scored pixels, layouts that fit the scene."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.io
from PIL import Image

from common.errors import DatasetError
from pserver.outputs.maps import map_figure, write_png
from pserver.outputs.palette import (
    COLOURBLIND,
    MIN_DISTANCE,
    UNLABELLED,
    distinct,
    ground_truth_colours,
    resolve_palette,
)

NAMES = ["soil", "vegetation", "water", "urban fabric"]


def scene(rows: int, cols: int, k: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A blocky prediction and a ground truth with unlabelled pixels and 10 % errors."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:rows, :cols]
    truth = (xx * k // cols + yy * 3 // rows) % k
    gt = truth + 1
    gt[rng.random((rows, cols)) < 0.2] = 0
    pred = truth.copy()
    flip = rng.random((rows, cols)) < 0.1
    pred[flip] = (pred[flip] + 1) % k
    return pred.astype(np.uint8), gt.astype(np.int64)


def inside_figure(fig: Any) -> list[str]:
    """Names of the legends, colour bars and titles whose bounding box leaves the figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    artists = {f"legend {i}": leg for i, leg in enumerate(fig.legends)}
    for i, axis in enumerate(fig.axes):
        artists[f"axis {i}"] = axis
        artists[f"axis {i} title"] = axis.title
    if fig._suptitle is not None:
        artists["suptitle"] = fig._suptitle
    out = []
    for name, artist in artists.items():
        ext = artist.get_window_extent(renderer)
        if ext.x0 < -0.5 or ext.y0 < -0.5 or ext.x1 > box.x1 + 0.5 or ext.y1 > box.y1 + 0.5:
            out.append(f"{name} {ext.bounds} outside {box.bounds}")
    return out


def test_default_palette_is_colourblind_safe_with_water_in_blue() -> None:
    table, where = resolve_palette("auto", NAMES)
    assert table[2] == COLOURBLIND[0] == (0, 114, 178)  # water
    assert set(table) <= set(COLOURBLIND) and len(set(table)) == 4
    assert "colour-blind" in where
    assert resolve_palette("auto", ["tree", "Water", "dirt"])[0][1] == (0, 114, 178)
    assert resolve_palette("tab20", NAMES)[0][0] == (31, 119, 180)  # class order, no water rule
    table, _ = resolve_palette("#ff0000,#00ff00,0/0/255,#123456", NAMES)
    assert table == [(255, 0, 0), (0, 255, 0), (0, 0, 255), (18, 52, 86)]
    table, _ = resolve_palette("soil=#a0522d", NAMES)
    assert table[0] == (160, 82, 45) and table[2] == (0, 114, 178)
    with pytest.raises(DatasetError, match="2 colours for 4 classes"):
        resolve_palette("#ff0000,#00ff00", NAMES)
    with pytest.raises(DatasetError, match="names class 'sand'"):
        resolve_palette("sand=#ffffff", NAMES)
    with pytest.raises(DatasetError, match="#rrggbb or r/g/b"):
        resolve_palette("red,green,blue,black", NAMES)


@pytest.mark.parametrize(
    "names",
    [["Rock", "Tree", "Water"], ["tree", "water", "dirt", "road"], ["Soil", "Tree", "Water"]],
    ids=["samson", "jasper-ridge", "samson-soil"],
)
def test_default_colours_follow_what_a_class_is(names: list[str]) -> None:
    blue, orange, green, _, _, vermillion, _ = COLOURBLIND
    table = dict(zip(names, resolve_palette("auto", names)[0], strict=True))
    expected = {"water": blue, "tree": green, "rock": orange, "soil": orange, "dirt": orange}
    expected["road"] = vermillion
    assert table == {n: expected[n.lower()] for n in names}


def test_agreement_colours_are_used_by_no_class() -> None:
    table = resolve_palette("auto", NAMES)[0]
    wrong = distinct(((255, 0, 255), (128, 0, 0)), [*table, UNLABELLED])
    assert wrong == (255, 0, 255)
    # a user palette that takes magenta moves "wrong" to the next candidate
    users = [(255, 0, 255), (0, 200, 0), (0, 0, 255), (255, 255, 0)]
    wrong = distinct(((255, 0, 255), (128, 0, 0)), [*users, UNLABELLED])
    assert wrong == (128, 0, 0)
    gaps = np.linalg.norm(np.array(users) - np.array(wrong), axis=1)
    assert gaps.min() >= MIN_DISTANCE


def test_ground_truth_colours_from_mat_and_envi(tmp_path: Path) -> None:
    gt = np.ones((3, 3), dtype=np.uint8)
    scipy.io.savemat(tmp_path / "g.mat", {"gt": gt, "class_colours": [[0, 0, 1.0], [1.0, 0.5, 0]]})
    assert ground_truth_colours(f"{tmp_path / 'g.mat'}:gt") == [(0, 0, 255), (255, 128, 0)]
    scipy.io.savemat(tmp_path / "plain.mat", {"gt": gt})
    assert ground_truth_colours(str(tmp_path / "plain.mat")) is None
    (tmp_path / "c.hdr").write_text(
        "ENVI\nsamples = 3\nlines = 3\nbands = 1\ndata type = 1\nfile type = ENVI Classification\n"
        "classes = 3\nclass lookup = { 0, 0, 0, 10, 20, 30, 200, 100, 0 }\n"
        "class names = { Unclassified, a, b }\ninterleave = bsq\nbyte order = 0\n"
        "header offset = 0\n"
    )
    gt.tofile(tmp_path / "c")
    assert ground_truth_colours(str(tmp_path / "c")) == [(10, 20, 30), (200, 100, 0)]
    table, where = resolve_palette("auto", ["a", "b"], ground_truth_colours(str(tmp_path / "c")))
    assert table == [(10, 20, 30), (200, 100, 0)] and where == "the ground truth's colours"


@pytest.mark.parametrize(
    "shape", [(570, 204), (204, 1200), (100, 100)], ids=["narrow", "wide", "square"]
)
def test_no_legend_or_title_leaves_the_figure(shape: tuple[int, int], tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    pred, gt = scene(*shape)
    rng = np.random.default_rng(1)
    title = "a_long_scene_name.mat: hsi-cnn, OA 0.912 on 8675 test pixels (training and "
    title += "guard-band pixels not scored)"
    long_names = [*NAMES[:3], "discontinuous urban fabric"]
    fig = map_figure(
        pred,
        long_names,
        gt,
        title,
        scored=rng.random(shape) < 0.8,
        rgb=rng.random((*shape, 3)),
        confidence=rng.random(shape),
    )
    try:
        assert inside_figure(fig) == []
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert labels == [  # numbered as in the ground truth: 0 is unlabelled
            "1: soil",
            "2: vegetation",
            "3: water",
            "4: discontinuous urban fabric",
            "unlabelled",
            "correct",
            "wrong",
            "not scored",
        ]
        wide = shape[1] / shape[0] > 1.6
        rows_of_panels = {round(a.get_position().y0, 3) for a in fig.axes[:5]}
        assert len(rows_of_panels) == (5 if wide else 1)  # stacked when wide, else side by side
    finally:
        plt.close(fig)
    plain = map_figure(pred, NAMES, title="x")
    try:
        assert inside_figure(plain) == []
    finally:
        plt.close(plain)
    write_png(tmp_path / "m.png", pred, NAMES, gt, title)
    assert Image.open(tmp_path / "m.png").text["Title"] == title
