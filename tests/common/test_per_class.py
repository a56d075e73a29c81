"""Per-class results: the arithmetic, the summary's per_class and the report's table."""

from __future__ import annotations

import numpy as np
import pytest

from common.training.metrics import confusion_matrix, scores_from_confusion
from common.training.summary import per_class_of
from launch.report import per_class_section, render_markdown


def test_per_class_scores_by_hand() -> None:
    y_true = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2, 2])
    y_pred = np.array([0, 0, 1, 2, 1, 1, 2, 2, 2, 0])
    matrix = confusion_matrix(y_true, y_pred, 4)  # class 3 has no test sample
    scores = scores_from_confusion(matrix, 0.5)
    assert scores.accuracy == (0.5, 1.0, 0.75, None)
    assert scores.support == (4, 2, 4, 0)
    assert scores.confusion[0] == (2, 1, 1, 0) and scores.confusion[3] == (0, 0, 0, 0)
    assert scores.oa == pytest.approx(0.7)
    assert scores.aa == pytest.approx((0.5 + 1.0 + 0.75) / 3)
    per_class = scores.per_class(["a", "b", "c", "d"])
    assert per_class["names"] == ["a", "b", "c", "d"]
    assert per_class["accuracy"] == [0.5, 1.0, 0.75, None]
    empty = scores_from_confusion(np.zeros((2, 2), dtype=np.int64), 0.0)
    assert empty.accuracy == (None, None) and empty.support == (0, 0)


def test_summary_takes_the_final_evaluation() -> None:
    evals = [
        {"version": 9, "accuracy": [1.0, 0.5], "support": [2, 2], "confusion": [[2, 0], [1, 1]]},
        {"version": 3, "accuracy": [0.0, 0.0], "support": [2, 2], "confusion": [[0, 2], [2, 0]]},
    ]
    assert per_class_of(evals, ("x", "y")) == {
        "names": ["x", "y"],
        "accuracy": [1.0, 0.5],
        "support": [2, 2],
        "confusion": [[2, 0], [1, 1]],
    }
    assert per_class_of([], ("x",)) is None
    assert per_class_of([{"version": 1, "oa": 0.5}], ("x",)) is None  # an older record


def _run(mode: str, accuracy: list[float | None]) -> dict:
    per_class = {"names": ["tree", "water"], "accuracy": accuracy, "support": [30, 20]}
    return {"mode": mode, "summary": {"per_class": per_class, "final": {"oa": 0.9}}}


def test_report_per_class_table_by_hand() -> None:
    data = {
        "settings": {
            "modes": ["weighted-sync", "async", "ddp"],
            "target_oa": None,
            "slowdowns": [1.0, 2.0],
            "slowdown_schedules": [],
            "dataset": "d.h5",
            "model": "m",
            "repeats": 3,
            "train": {
                "global_batch": 64,
                "optimizer": "sgd",
                "lr": 0.05,
                "lr_schedule": "constant",
                "epochs": 2,
                "max_steps": None,
                "seed": 0,
            },
        },
        "runs": [
            {**_run("weighted-sync", [0.9, 0.5]), "epoch_time_s": 1.0, "time_to_target_s": None},
            {**_run("weighted-sync", [0.8, 0.7]), "epoch_time_s": 1.0, "time_to_target_s": None},
            {**_run("weighted-sync", [0.7, 0.6]), "epoch_time_s": 1.0, "time_to_target_s": None},
            {**_run("async", [0.95, None]), "epoch_time_s": 1.0, "time_to_target_s": None},
            {"mode": "ddp", "error": "failed"},
        ],
    }
    lines = per_class_section(data)
    table = [row for line in lines for row in line.splitlines() if row.startswith("|")]
    assert table[0] == "| mode | tree (n=30) | water (n=20) |"
    assert table[2] == "| weighted-sync | 0.800 (0.700-0.900) | 0.600 (0.500-0.700) |"
    assert table[3] == "| async | 0.950 | - |"
    assert len(table) == 4  # ddp failed: no row
    assert "## Per-class accuracy" in render_markdown({**data, "runs": data["runs"][:4]})
    assert per_class_section({**data, "runs": [data["runs"][4]]}) == []
