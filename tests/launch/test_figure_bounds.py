"""Figures never clip: every figure kind, drawn from narrow and from wide data, keeps every
text inside the canvas, and no text runs into another panel's (matplotlib's own extents)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from launch import figures
from launch.cluster.spec import PRESETS
from launch.simulate.engine import ModeResult
from launch.simulate.report import write as write_simulation
from launch.simulate.spec import cluster_from_spec
from pserver.outputs.maps import map_figure

WIDE_NAMES = [f"discontinuous urban fabric {k}" for k in range(16)]


def texts_out_of_place(fig: Figure, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every text drawn whose box leaves the canvas or overlaps a text of another axes."""
    drawn: list[tuple[Text, Any]] = []
    draw = Text.draw

    def record(text: Text, renderer: Any) -> None:
        draw(text, renderer)
        if text.get_visible() and text.get_text().strip():
            drawn.append((text, text.get_window_extent(renderer)))

    monkeypatch.setattr(Text, "draw", record)
    FigureCanvasAgg(fig).draw()  # a new canvas: the figure may have been closed
    monkeypatch.setattr(Text, "draw", draw)
    box = fig.bbox
    problems = []
    # Pairwise as Bbox.overlaps tests it (edges touching count), for every pair at once: a wide
    # figure draws over a thousand texts.
    corners = np.array([ext.extents for _, ext in drawn]).reshape(-1, 2, 2)
    lo, hi = corners.min(axis=1), corners.max(axis=1)
    overlap = ((lo[:, None] <= hi[None]) & (lo[None] <= hi[:, None])).all(axis=2)
    axes = [text.axes for text, _ in drawn]
    for i, (text, ext) in enumerate(drawn):
        name = repr(text.get_text()[:40])
        if ext.x0 < -0.5 or ext.y0 < -0.5 or ext.x1 > box.x1 + 0.5 or ext.y1 > box.y1 + 0.5:
            problems.append(f"{name} {ext.bounds} outside {box.bounds}")
        for j in np.flatnonzero(overlap[i, :i]):
            if axes[i] is not axes[j]:
                problems.append(f"{name} overlaps {drawn[j][0].get_text()[:40]!r}")
    return problems


def _settings(modes: list[str], wide: bool) -> dict[str, Any]:
    cluster = PRESETS["small-1124"].spec("small-1124").describe() if wide else None
    return {
        "modes": modes,
        "dataset": "/a/rather/long/path/to/the/remote-sensing/scenes/JasperRidge_p11_t50.h5"
        if wide
        else "j.h5",
        "model": "hsi-cnn",
        "slowdowns": [1.0, 1.0, 2.0, 4.0] * (2 if wide else 1),
        "repeats": 3 if wide else 1,
        "target_oa": 0.9,
        "cluster": cluster,
        "train": {
            "global_batch": 64,
            "optimizer": "sgd",
            "lr": 0.05,
            "lr_schedule": "cosine",
            "epochs": 6,
            "max_steps": None,
            "seed": 0,
        },
    }


def _comparison(tmp_path: Path, wide: bool) -> dict[str, Any]:
    modes = ["weighted-sync", "equal-sync", "async", "ddp", "single"] if wide else ["equal-sync"]
    names = WIDE_NAMES if wide else ["a", "b"]
    workers = [f"w{i}-x{s:g}" for i, s in enumerate(_settings(modes, wide)["slowdowns"])]
    runs = []
    for mode in modes:
        run_dir = tmp_path / mode
        run_dir.mkdir()
        rounds = [
            {
                "event": "round",
                "t": 1.0 + r,
                "round": r,
                "round_s": 0.5,
                "workers": [
                    {"worker": w, "batch": 8, "speed": 100.0, "compute_s": 0.1, "transfer_s": 0.1}
                    for w in workers[: 1 + r % len(workers)]
                ],
            }
            for r in range(30)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rounds))
        k = len(names)
        summary = {
            "per_class": {
                "names": names,
                "accuracy": [0.5] * k,
                "confusion": (np.eye(k, dtype=int) * 1234 + 7).tolist(),
            }
        }
        curve = [
            {"time_s": t, "samples": 100 * t, "oa": 0.5 + t / 20, **({"subset": 1072} if t else {})}
            for t in range(5)
        ]
        runs.append(
            {
                "mode": mode,
                "repeat": 1,
                "run_dir": str(run_dir),
                "epoch_time_s": 1.0,
                "curve": curve,
                "summary": summary,
            }
        )
    return {"settings": _settings(modes, wide), "initial": {"oa": 0.25}, "runs": runs}


def _simulation(tmp_path: Path, wide: bool) -> None:
    counts = (8, 16, 32, 64, 128, 256) if wide else (8, 16)
    rows = [
        (
            {"workers": n, "gbit": 10.0, "mode": mode},
            ModeResult(mode, n, 4, 20, 1.0, 60.0 + n, False),
        )
        for n in counts
        for mode in ("weighted-sync", "equal-sync", "async", "ddp")
    ]
    spec = {
        "model_params": 1e6,
        "global_batch": 64,
        "samples": 1000,
        "groups": [{"count": 8, "per_sample_ms": 1}],
    }
    write_simulation(tmp_path, cluster_from_spec(spec), rows, "spec.yaml")


def _map(wide: bool) -> None:
    rows, cols = (204, 1200) if wide else (570, 204)
    k = 16 if wide else 3
    classes = (np.arange(rows * cols).reshape(rows, cols) % k).astype(np.uint8)
    names = WIDE_NAMES[:k] if wide else ["rock", "tree", "water"]
    title = "a_rather_long_scene_name.mat: hsi-cnn, OA 0.912 on 8675 test pixels (training "
    title += "and guard-band pixels not scored)"
    map_figure(classes, names, classes.astype(np.int64) + 1, title).savefig("unused.png")


DRAWS: dict[str, Callable[[Path, bool], object]] = {
    "curves": lambda p, w: figures.plot_curves(_comparison(p, w), p / "report"),
    "timeline": lambda p, w: figures.plot_timeline(_comparison(p, w), p / "timeline"),
    "confusion": lambda p, w: figures.plot_confusion(_comparison(p, w), p / "confusion"),
    "simulation": _simulation,
    "map": lambda p, w: _map(w),
}


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("kind", sorted(DRAWS))
def test_no_figure_clips_a_text(
    kind: str, wide: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: drawn.append(fig))
    DRAWS[kind](tmp_path, wide)
    assert drawn, f"{kind}: no figure drawn"
    for fig in drawn:
        assert texts_out_of_place(fig, monkeypatch) == []


def test_the_check_finds_a_clipped_text_and_texts_of_two_panels_that_overlap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fig = Figure(figsize=(4, 2))
    left, right = fig.subplots(1, 2)
    left.text(0.9, 0.5, "a label far too long for its panel", transform=left.transAxes)
    right.text(0.0, 0.5, "its neighbour", transform=right.transAxes)
    fig.text(0.98, 0.1, "runs off the canvas")
    problems = texts_out_of_place(fig, monkeypatch)
    assert any("overlaps" in p and "its neighbour" in p for p in problems), problems
    assert any("'runs off the canvas'" in p and "outside" in p for p in problems), problems
    assert texts_out_of_place(Figure(figsize=(4, 2)), monkeypatch) == []


def test_the_timeline_keeps_a_row_for_a_worker_that_sat_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: drawn.append(fig))
    data = _comparison(tmp_path, wide=False)
    members = [("w0", "w3") if r < 2 else ("w0",) for r in range(30)]  # w3 sits out from round 2
    rounds = [
        {"event": "round", "t": 1.0 + r, "round": r, "round_s": 0.5,
         "workers": [{"worker": w, "batch": 8, "compute_s": 0.1} for w in members[r]]}
        for r in range(30)
    ]  # fmt: skip
    Path(data["runs"][0]["run_dir"], "metrics.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in rounds)
    )
    figures.plot_timeline(data, tmp_path / "timeline")
    (axis,) = [a for a in drawn[0].axes if a.get_yticklabels()]
    assert [t.get_text() for t in axis.get_yticklabels()] == ["w0", "w3"]
    assert "sat out these rounds (w3)" in axis.get_title()
