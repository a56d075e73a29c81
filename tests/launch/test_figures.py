"""Report figures by hand: median and band, the t = 0 point, timeline and confusion files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from launch import figures
from launch.cluster.spec import PRESETS
from launch.compare import initial_scores
from launch.report import cluster_lines, schedule_section
from tests.support.live import live_server, published

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _settings(modes: list[str]) -> dict:
    return {
        "modes": modes,
        "dataset": "/data/jasper.h5",
        "model": "hsi-cnn",
        "slowdowns": [1.0, 4.0],
        "repeats": 2,
        "target_oa": 0.8,
        "train": {
            "global_batch": 64,
            "optimizer": "sgd",
            "lr": 0.05,
            "lr_schedule": "cosine",
            "epochs": 3,
            "max_steps": None,
            "seed": 0,
        },
    }


def _run(mode: str, repeat: int, curve: list[tuple[float, int, float]], **extra: object) -> dict:
    return {
        "mode": mode,
        "repeat": repeat,
        "run_dir": extra.pop("run_dir", "/nonexistent"),
        "epoch_time_s": curve[-1][0] / len(curve),
        "curve": [{"time_s": t, "samples": s, "oa": oa} for t, s, oa in curve],
        "summary": extra.pop("summary", {}),
    }


def test_median_band_by_hand() -> None:
    a = np.array([[0.0, 0.2], [1.0, 0.6], [2.0, 0.8]])
    b = np.array([[0.0, 0.2], [2.0, 0.4]])  # ends at x = 2 too, coarser
    c = np.array([[0.0, 0.2], [1.0, 1.0]])  # ends early: absent beyond x = 1
    x, med, low, high = figures.median_band([a, b, c])
    assert x.tolist() == [0.0, 1.0, 2.0]
    assert med.tolist() == pytest.approx([0.2, 0.6, 0.6])  # at 1: median of 0.6, 0.3, 1.0
    assert low.tolist() == pytest.approx([0.2, 0.3, 0.4])
    assert high.tolist() == pytest.approx([0.2, 1.0, 0.8])


def test_curve_points_start_at_zero_with_the_initial_model() -> None:
    run = _run("async", 1, [(1.5, 100, 0.6), (3.0, 200, 0.7)])
    assert figures.curve_points(run, "time_s", 0.25).tolist() == [[0, 0.25], [1.5, 0.6], [3, 0.7]]
    assert figures.curve_points(run, "samples", None).tolist() == [[100, 0.6], [200, 0.7]]


def test_settings_title_names_the_settings() -> None:
    title = figures.settings_title(_settings(["async"]))
    for part in ("jasper.h5", "hsi-cnn", "slowdowns 1,4", "B=64", "lr 0.05 (cosine)", "3 epochs"):
        assert part in title
    assert "cluster" not in title
    preset = PRESETS["small-1124"].spec("small-1124")
    emulated = {**_settings(["async"]), "cluster": preset.describe()}
    assert "cluster small-1124: workers 0.4/0.4/0.2/0.1 cores" in figures.settings_title(emulated)


def _round(t: float, round_s: float, batches: tuple[int, int]) -> dict:
    workers = [
        {"worker": name, "batch": b, "speed": 100.0}
        for name, b in zip(("w0", "w1"), batches, strict=True)
    ]
    return {"event": "round", "t": t, "round": int(t), "round_s": round_s, "workers": workers}


def test_figures_are_written_as_png_and_svg(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    for run_dir in (sync_dir, async_dir):
        run_dir.mkdir()
    rounds = [_round(1.0 + i, 0.5, (40, 10)) for i in range(30)]
    (sync_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (async_dir / "metrics.jsonl").write_text(json.dumps({"event": "push", "t": 1.0}) + "\n")
    confusion = {"names": ["water", "soil"], "accuracy": [0.9, 0.5], "confusion": [[9, 1], [3, 3]]}
    data = {
        "settings": _settings(["weighted-sync", "async"]),
        "initial": {"oa": 0.25},
        "runs": [
            _run("weighted-sync", 1, [(1.0, 100, 0.6)], run_dir=str(sync_dir)),
            _run("weighted-sync", 2, [(1.2, 100, 0.7)], run_dir=str(sync_dir)),
            _run("async", 1, [(1.0, 100, 0.5)], run_dir=str(async_dir), summary={}),
        ],
    }
    written = figures.plot_curves(data, tmp_path / "report")
    assert [Path(p).name for p in written] == ["report.png", "report.svg"]
    assert "weighted-sync (2 runs)" in Path(written[1]).read_text()
    assert Path(written[0]).read_bytes().startswith(PNG_SIGNATURE)
    assert "<svg" in Path(written[1]).read_text()
    timeline = figures.plot_timeline(data, tmp_path / "timeline")
    assert timeline is not None and all(Path(p).stat().st_size > 1000 for p in timeline)
    svg = Path(timeline[1]).read_text()
    assert "weighted-sync" in svg and "async," not in svg  # only the sync mode has a panel
    with caplog.at_level(logging.INFO, logger="launch.figures"):
        assert figures.plot_confusion(data, tmp_path / "confusion") is None
    assert "confusion-matrix figure skipped" in caplog.text
    assert not (tmp_path / "confusion.png").exists()
    data["runs"][-1]["summary"] = {"per_class": confusion}  # the async run
    written = figures.plot_confusion(data, tmp_path / "confusion")
    assert written is not None and Path(written[0]).read_bytes().startswith(PNG_SIGNATURE)
    assert "soil" in Path(written[1]).read_text()
    matrix, names = figures.confusion_of({"per_class": confusion})
    assert matrix.tolist() == [[9, 1], [3, 3]] and names == ["water", "soil"]
    assert figures.confusion_of({"per_class": {"confusion": [[1, 2]]}}) is None  # not square


def test_budgets_are_drawn_under_the_curves_and_no_text_leaves_the_canvas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = PRESETS["leave-return"].spec("leave-return").describe()
    applied = [
        {"node": 1, "change": "off@33.3%", "cores": None, "t": 9.0, "train_t": 4.0},
        {"node": 1, "change": "on@66.7%", "cores": 0.4, "t": 15.0, "train_t": 10.0},
    ]
    assert figures.budget_steps(cluster, applied, 12.0)[1] == ([0, 4, 10, 12], [0.4, 0, 0.4, 0.4])
    assert figures.budget_steps(cluster, applied, 12.0)[3] == ([0, 12], [0.1, 0.1])
    summary = {"schedule": applied, "train_time_s": 12.0}
    data = {
        "settings": {
            **_settings(["weighted-sync", "ddp"]),
            "dataset": "/data/jasper_ridge_11x11_patches_half_of_each_class_for_training.h5",
            "cluster": cluster,
        },
        "runs": [
            _run("weighted-sync", 1, [(6.0, 100, 0.6), (12.0, 200, 0.8)], summary=summary),
            _run("ddp", 1, [(8.0, 100, 0.6)], summary={"train_time_s": 8.0}),  # no schedule
        ],
    }
    assert list(figures.scheduled_runs(data)) == ["weighted-sync"]
    assert "node 1: `0.4;off@33.3%;on@66.7%`" in "\n".join(cluster_lines(cluster))  # in full
    table = schedule_section(data)[2].splitlines()
    assert table[0] == "| mode | node 1: off@33.3% | node 1: on@66.7% |"
    assert table[2:] == ["| weighted-sync | 4.0 | 10.0 |"]  # ddp recorded no schedule
    drawn: list = []
    monkeypatch.setattr(figures, "_save", lambda fig, stem: drawn.append(fig) or [])
    figures.plot_curves(data, Path("report"))
    fig = drawn[0]
    budgets = next(a for a in fig.axes if "CPU budget per node" in a.get_title())
    time_axis = next(a for a in fig.axes if a.get_title() == "OA against training time")
    assert budgets.get_shared_x_axes().joined(budgets, time_axis)
    assert [line.get_ydata().tolist() for line in budgets.get_lines()][1] == [0.4, 0, 0.4, 0.4]
    fig.canvas.draw()
    highest = budgets.transData.transform((0, 0.4))[1]  # the highest budget, in pixels
    assert budgets.get_legend().get_window_extent().y0 > highest  # the legend hides no line
    drawn_box = fig.get_tightbbox(fig.canvas.get_renderer())  # all that is drawn, in inches
    width, height = fig.get_size_inches()
    assert drawn_box.x0 >= 0 and drawn_box.y0 >= 0, drawn_box
    assert drawn_box.x1 <= width + 1e-3 and drawn_box.y1 <= height + 1e-3, (drawn_box, width)


async def test_initial_scores_are_the_servers_version_zero(small_hsi: Path) -> None:
    async with live_server(small_hsi, seed=3) as server:
        version = server.updater.version
        served = server.evaluations.evaluator.evaluate(published(server).numpy())
    assert version == 0
    mine = initial_scores(small_hsi, "hsi-cnn", seed=3)
    assert mine == {"oa": served.oa, "aa": served.aa, "kappa": served.kappa, "loss": served.loss}
    assert initial_scores(small_hsi, "hsi-cnn", seed=4) != mine  # the seed matters
