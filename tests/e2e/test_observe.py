"""A real ``pslaunch compare`` run: TensorBoard per run, the t = 0 point and the report figures."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from common.data.convert.synth import synth_hsi
from launch.compare import CompareConfig, run_compare
from launch.figures import confusion_of
from launch.settings import TrainSettings
from tests.support.tensorboard import scalars

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MODES = ("weighted-sync", "async", "ddp")


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """Three modes, one run each, two epochs of a small synthetic scene; and the log.

    (Repeats and the band over them are covered by tests/launch/test_figures.py on hand-made
    data.)"""
    root = tmp_path_factory.mktemp("observe")
    data = root / "hsi.h5"
    synth_hsi(data, samples=400, bands=16, size=32, classes=4, train_fraction=0.3, seed=4)
    config = CompareConfig(
        dataset=data,
        model="hsi-cnn",
        modes=MODES,
        slowdowns=(1.0, 2.0),
        out=root / "cmp",
        train=TrainSettings(global_batch=32, epochs=2),
        repeats=1,
    )
    handler, logger = _Capture(), logging.getLogger("launch")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = run_compare(config, show_progress=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return result, "\n".join(handler.lines)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_every_run_has_an_oa_scalar_per_evaluation(compared: tuple[dict, str]) -> None:
    data, _ = compared
    assert [r.get("error") for r in data["runs"]] == [None] * len(MODES)
    for run in data["runs"]:
        run_dir = Path(run["run_dir"])
        assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
        series = scalars(run_dir)
        evals = _events(run_dir, "eval")
        assert len(evals) >= 2  # one per epoch
        oa = series["eval/oa"]
        assert [s.step for s in oa] == [e["samples"] for e in evals], run["mode"]
        assert [s.value for s in oa] == pytest.approx([e["oa"] for e in evals], abs=1e-6)
        assert len(series["eval/kappa"]) == len(series["eval/loss"]) == len(evals)
        if run["mode"] == "async":  # every push is counted in exactly one record
            assert sum(s.value for s in series["push/count"]) == len(_events(run_dir, "push")) > 0
            assert "round/seconds" not in series
        else:  # PS sync rounds and DDP steps alike
            rounds = _events(run_dir, "round")
            assert sum(s.value for s in series["round/count"]) == len(rounds) > 0
            assert len(series["round/idle_share"]) == len(series["round/count"])
            names = {w["worker"] for w in rounds[0]["workers"]}
            for name in names:
                shares = series[f"worker/{name}/batch_share"]
                assert 0 < shares[-1].value <= 1  # a worker may take a whole round


def test_report_figures(compared: tuple[dict, str]) -> None:
    data, logged = compared
    initial = data["initial"]
    assert 0 <= initial["oa"] <= 1 and initial["loss"] > 0
    report = data["report"]
    for key in ("png", "svg", "timeline_png", "timeline_svg"):
        assert Path(report[key]).is_file(), key
    assert Path(report["png"]).read_bytes().startswith(PNG_SIGNATURE)
    timeline_svg = Path(report["timeline_svg"]).read_text()
    assert "weighted-sync, repeat" in timeline_svg and "ddp, repeat" in timeline_svg
    assert "async, repeat" not in timeline_svg  # no rounds in async mode
    curve_svg = Path(report["svg"]).read_text()
    assert f"OA {initial['oa']:.3f}" in curve_svg  # the t = 0 point is named in the title
    has_matrix = any(confusion_of(r["summary"]) for r in data["runs"])
    if has_matrix:
        assert Path(report["confusion_png"]).is_file()
    else:
        assert "confusion_png" not in report
        assert "confusion-matrix figure skipped" in logged
