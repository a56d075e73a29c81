"""Classification maps as files: a PNG with a legend, a .npy array and a georeferenced GeoTIFF."""

from __future__ import annotations

import colorsys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.data.convert.cube import GeoRef
from common.errors import DatasetError

# A fixed colour per class index, so maps of the same classes always look alike. No greys or
# black: black marks unlabelled pixels.
PALETTE = (
    (31, 119, 180),
    (44, 160, 44),
    (214, 39, 40),
    (255, 187, 20),
    (148, 103, 189),
    (23, 190, 207),
    (140, 86, 75),
    (227, 119, 194),
    (188, 189, 34),
    (255, 127, 14),
    (174, 199, 232),
    (152, 223, 138),
    (255, 152, 150),
    (197, 176, 213),
    (158, 218, 229),
    (196, 156, 148),
    (247, 182, 210),
    (219, 219, 141),
    (255, 204, 153),
    (0, 92, 49),
)
UNLABELLED = (0, 0, 0)
CORRECT = (205, 205, 205)
WRONG = (220, 40, 40)
MAX_SIDE = 2000  # pixels of the longest side drawn in the PNG; larger maps are subsampled


def colours(num_classes: int) -> list[tuple[int, int, int]]:
    """The RGB colour (0-255) of each class: ``PALETTE``, then evenly spread hues.

    Args:
        num_classes: K.

    Returns:
        K colours; the same K always gives the same list.
    """
    out = list(PALETTE[:num_classes])
    golden = 0.618033988749895
    for k in range(len(out), num_classes):
        hue = (k * golden) % 1.0
        light = 0.45 if k % 2 else 0.6
        r, g, b = colorsys.hls_to_rgb(hue, light, 0.75)
        out.append((round(r * 255), round(g * 255), round(b * 255)))
    return out


def _rgb(index_map: np.ndarray, table: Sequence[tuple[int, int, int]]) -> np.ndarray:
    return np.asarray(table, dtype=np.uint8)[index_map]


def write_png(
    path: Path,
    classes: np.ndarray,
    class_names: Sequence[str],
    gt: np.ndarray | None = None,
    title: str = "",
) -> None:
    """Draw the class map with a legend of class names and colours.

    With ``gt`` three panels: the prediction for every pixel, the ground truth (unlabelled
    pixels in black) and where they agree (correct, wrong, unlabelled).

    Args:
        path: the PNG to write.
        classes: (rows, cols) predicted class indices.
        class_names: K names.
        gt: (rows, cols) ground truth, 0 = unlabelled and k + 1 = class k; optional.
        title: a line above the panels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    step = max(1, -(-max(classes.shape) // MAX_SIDE))
    shown = classes[::step, ::step]
    table = colours(len(class_names))
    panels = [("prediction (every pixel)", _rgb(shown, table))]
    unlabelled = []
    if gt is not None:
        g = gt[::step, ::step]
        panels.append(("ground truth", _rgb(g, [UNLABELLED, *table])))
        agree = np.where(g == 0, 0, np.where(g - 1 == shown, 1, 2))
        panels.append(("agreement", _rgb(agree, [UNLABELLED, CORRECT, WRONG])))
        unlabelled = [Patch(color=_colour(UNLABELLED, 255), label="unlabelled")]
    rows, cols = shown.shape
    side = 4.2
    aspect = min(max(cols / rows, 0.4), 2.5)
    width = max(side * aspect * len(panels) + 0.6, 5.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, side + 1.5), squeeze=False)
    for axis, (name, image) in zip(axes[0], panels, strict=True):
        axis.imshow(image, interpolation="nearest")
        axis.set_title(name)
        axis.set_xticks([])
        axis.set_yticks([])
    handles = [
        Patch(color=_colour(c, 255), label=f"{k}: {n}")
        for k, (c, n) in enumerate(zip(table, class_names, strict=True))
    ]
    fig.legend(
        handles=handles + unlabelled,
        loc="lower center",
        ncol=min(len(handles) + len(unlabelled), 6),
        frameon=False,
        title="classes",
    )
    if gt is not None:
        axes[0][-1].legend(
            handles=[
                Patch(color=_colour(CORRECT, 255), label="correct"),
                Patch(color=_colour(WRONG, 255), label="wrong"),
                Patch(color=_colour(UNLABELLED, 255), label="unlabelled"),
            ],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.02),
            ncol=3,
            frameon=False,
        )
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.03, right=0.97, bottom=0.2, top=0.84 if title else 0.9, wspace=0.06)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_npy(path: Path, classes: np.ndarray) -> None:
    """Save the (rows, cols) class indices 0..K-1 as a .npy file (no pickle)."""
    np.save(path, classes, allow_pickle=False)


def write_geotiff(
    path: Path, classes: np.ndarray, georef: GeoRef | None, class_names: Sequence[str]
) -> None:
    """Write the map as a single-band GeoTIFF with the input's georeferencing.

    Values are class k + 1 (0 = no data, like a ground-truth map), with a colour table and the
    class names as tags.

    Raises:
        DatasetError: the file cannot be written.
    """
    from common.data.convert.geotiff import write_class_geotiff

    if classes.ndim != 2:
        raise DatasetError(f"a class map is (rows, cols), got {classes.shape}")
    write_class_geotiff(path, classes, georef, class_names, colours(len(class_names)))


def _colour(rgb: tuple[int, int, int] | np.ndarray, scale: int) -> tuple[float, float, float]:
    """An 8-bit RGB colour as matplotlib's (r, g, b) in [0, 1]."""
    r, g, b = (float(v) / scale for v in rgb)
    return (r, g, b)
