"""Classification maps drawn as a PNG: prediction, ground truth and agreement, with a legend."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pserver.outputs.palette import (
    CORRECT_CANDIDATES,
    UNLABELLED,
    WRONG_CANDIDATES,
    distinct,
    resolve_palette,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

NOT_SCORED_CANDIDATES = ((95, 95, 95), (130, 130, 130), (60, 60, 60))
MAX_SIDE = 2000  # pixels of the longest side drawn in the PNG; larger maps are subsampled
PANEL_IN = 4.2  # inches of a panel's longer side
WIDE = 1.6  # scenes with cols / rows above this stack their panels vertically


def _rgb(index_map: np.ndarray, table: Sequence[tuple[int, int, int]]) -> np.ndarray:
    return np.asarray(table, dtype=np.uint8)[index_map]


def _patch(rgb: tuple[int, int, int], label: str) -> Patch:
    """A legend entry of an 8-bit RGB colour."""
    from matplotlib.patches import Patch

    r, g, b = rgb
    return Patch(color=(r / 255, g / 255, b / 255), label=label)


def _layout(rows: int, cols: int, panels: int) -> tuple[int, int, float, float]:
    """Grid (nrows, ncols) and figure size in inches for ``panels`` images of rows x cols.

    Narrow and square scenes sit side by side; wide ones (cols / rows > ``WIDE``) are stacked.
    """
    ratio = cols / rows
    if ratio > WIDE:
        width = 9.0
        return panels, 1, width, panels * (width / ratio + 0.35)
    height = PANEL_IN
    panel_w = max(height * ratio, 1.6)
    return 1, panels, max(panel_w * panels + 0.3 * panels, 6.0), height


def map_figure(
    classes: np.ndarray,
    class_names: Sequence[str],
    gt: np.ndarray | None = None,
    title: str = "",
    *,
    palette: Sequence[tuple[int, int, int]] | None = None,
    scored: np.ndarray | None = None,
    rgb: np.ndarray | None = None,
    confidence: np.ndarray | None = None,
) -> Figure:
    """Build the map figure: panels side by side (narrow scenes) or stacked (wide ones), and
    one legend below them that constrained layout keeps inside the figure.

    Args:
        classes: (rows, cols) predicted class indices (K or more: no data, drawn black).
        class_names: K names.
        gt: (rows, cols) ground truth, 0 = unlabelled and k + 1 = class k; adds the ground
            truth and agreement panels.
        title: a line above the panels (wrapped to the figure's width).
        palette: K RGB colours (default: ``resolve_palette`` ``auto``, by class name).
        scored: (rows, cols) bool, the labelled pixels that were scored (e.g. the test split);
            the agreement panel marks the other labelled pixels "not scored". None: all.
        rgb: (rows, cols, 3) floats in [0, 1]: a composite panel drawn first.
        confidence: (rows, cols) floats in [0, 1]: the largest class probability, drawn last
            with a colour bar.

    Returns:
        The matplotlib figure (close it when done).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = max(1, -(-max(classes.shape) // MAX_SIDE))
    shown = classes[::step, ::step]
    table = list(palette) if palette is not None else resolve_palette("auto", class_names)[0]
    panels: list[tuple[str, np.ndarray]] = []
    if rgb is not None:
        panels.append(("composite", rgb[::step, ::step]))
    nodata = shown >= len(class_names)  # not classified (NaN in its patch)
    prediction = _rgb(np.minimum(shown, len(table)), [*table, UNLABELLED])
    panels.append(("prediction (every pixel)", prediction))
    extra: list[Patch] = []
    if gt is not None:
        g = gt[::step, ::step]
        correct = distinct(CORRECT_CANDIDATES, [*table, UNLABELLED])
        wrong = distinct(WRONG_CANDIDATES, [*table, UNLABELLED, correct])
        panels.append(("ground truth", _rgb(g, [UNLABELLED, *table])))
        agree = np.where((g == 0) | nodata, 0, np.where(g - 1 == shown, 1, 2))
        agreement = [UNLABELLED, correct, wrong]
        labels = ("unlabelled", "correct", "wrong")
        extra = [_patch(c, n) for c, n in zip(agreement, labels, strict=True)]
        if scored is not None:
            grey = distinct(NOT_SCORED_CANDIDATES, [*table, *agreement])
            agree = np.where((g > 0) & ~scored[::step, ::step], 3, agree)
            agreement.append(grey)
            extra.append(_patch(grey, "not scored"))
        panels.append(("agreement", _rgb(agree, agreement)))
    if nodata.any():
        extra.append(_patch(UNLABELLED, "no data (NaN in its patch)"))
    if confidence is not None:
        panels.append(("confidence (max probability)", confidence[::step, ::step]))
    nrows, ncols, width, height = _layout(shown.shape[0], shown.shape[1], len(panels))
    handles = [  # numbered as the ground truth numbers classes
        _patch(c, f"{k + 1}: {n}") for k, (c, n) in enumerate(zip(table, class_names, strict=True))
    ]
    entries = handles + extra
    label_in = 0.35 + 0.085 * max(len(str(h.get_label())) for h in entries)
    legend_cols = max(1, min(len(entries), int((width - 0.3) / label_in)))
    legend_rows = -(-len(entries) // legend_cols)
    lines = textwrap.wrap(title, max(20, int(width * 11))) if title else []
    fig = plt.figure(
        figsize=(width, height + 0.3 * legend_rows + 0.6 + 0.25 * len(lines)), layout="constrained"
    )
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for axis, (name, image) in zip(axes, panels, strict=True):
        if image.ndim == 2:  # the confidence map
            shown_conf = axis.imshow(image, interpolation="nearest", vmin=0.0, vmax=1.0)
            fig.colorbar(shown_conf, ax=axis, shrink=0.8)
        else:
            axis.imshow(image, interpolation="nearest")
        axis.set_title(name, fontsize=10)
        axis.set_xticks([])
        axis.set_yticks([])
    fig.legend(
        handles=entries, loc="outside lower center", ncol=legend_cols, frameon=False, fontsize=9
    )
    if lines:
        fig.suptitle("\n".join(lines), fontsize=11)
    return fig


def write_png(
    path: Path,
    classes: np.ndarray,
    class_names: Sequence[str],
    gt: np.ndarray | None = None,
    title: str = "",
    **options: Any,
) -> None:
    """Draw the class map with a legend of class names and colours (see ``map_figure``).

    With ``gt`` three panels: the prediction for every pixel, the ground truth (unlabelled
    pixels in black) and where they agree, in colours no class uses.

    Args:
        path: the PNG to write.
        classes: (rows, cols) predicted class indices.
        class_names: K names.
        gt: (rows, cols) ground truth, 0 = unlabelled and k + 1 = class k; optional.
        title: a line above the panels.
        options: ``palette``, ``scored``, ``rgb``, ``confidence`` of ``map_figure``.
    """
    import matplotlib.pyplot as plt

    fig = map_figure(classes, class_names, gt, title, **options)
    fig.savefig(path, dpi=110, metadata={"Title": title, "Software": "rs-pserver"})
    plt.close(fig)
