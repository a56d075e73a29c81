"""Round breakdown arithmetic, the live view's bounds and the metrics text, by hand."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.training.rounds import breakdown, idle_share
from pserver.observe import liveview, prometheus
from pserver.observe.liveview import LiveView


def test_breakdown_prefers_recorded_times_and_derives_the_rest() -> None:
    event = {
        "event": "round",
        "round_s": 0.5,
        "workers": [
            {"worker": "a", "batch": 30, "speed": 100.0},  # PS today: batch and speed only
            {"worker": "b", "batch": 10, "speed": 50.0, "compute_s": 0.1, "emulated_s": 0.3},
            {"worker": "c", "batch": 0, "speed": 0.0, "transfer_s": 0.05, "idle_s": 0.4},
            {"worker": 7, "batch": 5},  # no usable name: skipped
        ],
    }
    a, b, c = breakdown(event)
    assert (a.share, b.share, c.share) == (0.75, 0.25, 0.0)
    assert a.compute_s == pytest.approx(0.3) and a.compute_estimated and a.idle_derived
    assert a.idle_s == pytest.approx(0.2) and a.transfer_s is None
    assert b.compute_s == 0.3 and not b.compute_estimated  # emulated_s wins over compute_s
    assert b.idle_s == pytest.approx(0.2)
    assert c.compute_s == 0.0 and c.transfer_s == 0.05
    assert c.idle_s == 0.4 and not c.idle_derived
    assert idle_share([a, b, c], 0.5) == pytest.approx((0.2 + 0.2 + 0.4) / 1.5)
    assert breakdown({"round_s": "x", "workers": []}) == []
    assert breakdown({"round_s": float("nan"), "workers": [{"worker": "a", "batch": 1}]}) == []


def test_live_view_is_bounded_and_keeps_the_whole_curve() -> None:
    view = LiveView([{"event": "start", "t": 0.0, "mode": "async", "workers": [1, 2]}])
    assert view.start == {"event": "start", "t": 0.0, "mode": "async"}  # scalars only
    count = 3 * liveview.MAX_EVALS
    for i in range(count):
        view({"event": "eval", "t": float(i), "version": i, "oa": i / count, "samples": i})
        view(
            {"event": "push", "t": float(i), "worker": f"w{i % 3}", "batch": 2, "staleness": i % 4}
        )
        view(
            {
                "event": "round",
                "t": float(i),
                "round_s": 0.1,
                "workers": [{"worker": "a", "batch": 4}],
            }
        )
    snap = view.snapshot()
    assert len(snap["evals"]) <= liveview.MAX_EVALS
    assert snap["evals"][0]["version"] == 0 and snap["evals"][-1]["version"] == count - 1
    assert len(snap["pushes"]) == liveview.MAX_PUSHES and snap["pushes_seen"] == count
    assert len(snap["rounds"]) == liveview.MAX_ROUNDS and snap["rounds_seen"] == count
    w0 = snap["workers"]["w0"]
    assert w0["batch_share"] == pytest.approx(1 / 3 * 2 / 6, abs=1e-3)  # 'a' has 4 of 6
    assert snap["workers"]["a"]["idle_share"] == 0.0  # no speed: no compute estimate, idle 0
    assert w0["staleness_max"] == 3 and w0["staleness_mean"] == pytest.approx(1.5, abs=0.01)
    for i in range(2 * liveview.MAX_WORKERS):
        view({"event": "push", "t": 1.0, "worker": f"x{i}", "batch": 1, "staleness": 0})
    assert len(view.workers) == liveview.MAX_WORKERS


def test_live_view_json_is_strict_and_complete() -> None:
    view = LiveView()
    view({"event": "eval", "t": 1.0, "version": 3, "oa": 0.5, "loss": float("nan")})
    view({"event": "round", "t": float("inf"), "round_s": float("nan"), "workers": []})
    view({"event": "push", "t": 2.0, "worker": "w", "batch": -4, "staleness": "x"})
    text = view.to_json(now=float("nan"))
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert data["evals"] == [
        {"t": 1.0, "version": 3, "epoch": None, "samples": None, "oa": 0.5, "aa": None,
         "kappa": None, "loss": None, "test_samples": None, "subset": None}
    ]  # fmt: skip
    assert data["rounds"] == [] and data["rounds_seen"] == 0  # an unusable round is ignored
    assert data["pushes"] == [
        {"t": 2.0, "version": None, "worker": "w", "batch": 0, "staleness": None}
    ]
    assert data["now"] == 0.0 and data["t"] == 2.0
    assert {k for k in data if k != "now"} == set(view.snapshot())


def test_live_view_idle_totals_over_rounds() -> None:
    view = LiveView()
    for _ in range(4):
        view(
            {
                "event": "round",
                "t": 1.0,
                "round_s": 1.0,
                "workers": [
                    {"worker": "fast", "batch": 30, "speed": 60.0},
                    {"worker": "slow", "batch": 10, "speed": 10.0},
                ],
            }
        )
    totals = view.snapshot()["workers"]
    assert totals["fast"]["idle_s"] == pytest.approx(2.0)  # 4 x (1.0 - 30/60)
    assert totals["fast"]["idle_share"] == pytest.approx(0.5)
    assert totals["slow"]["idle_s"] == 0.0 and totals["fast"]["idle_derived"]
    assert totals["fast"]["batch_share"] == 0.75


def test_a_worker_left_out_of_the_latest_round_has_no_batch_share() -> None:
    """The model planner may plan a worker at 0: its share is 0, not that of its last round."""
    view = LiveView()
    both = [{"worker": "fast", "batch": 30, "speed": 60.0}, {"worker": "slow", "batch": 10}]
    for workers in (both, both[:1]):
        view({"event": "round", "t": 1.0, "round_s": 1.0, "workers": workers})
    totals = view.snapshot()["workers"]
    assert totals["fast"]["batch_share"] == 1.0 and totals["slow"]["batch_share"] == 0.0


def test_metrics_escape_labels_and_skip_missing_values() -> None:
    status = {
        "mode": "async",
        "model": 'm"1',
        "version": 12,
        "training": True,
        "last_eval": {"oa": 0.5, "aa": float("nan"), "kappa": None, "loss": 1.25},
        "workers": [
            {"name": 'a\\b"c\nd', "device": "cpu", "speed": 12.5, "active": False, "pushes": 3}
        ],
    }
    view = {"workers": {'a\\b"c\nd': {"staleness_last": 2, "batch_share": None}}}
    text = prometheus.render(status, view)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["pserver_info"].samples[0].labels["model"] == 'm"1'
    assert families["pserver_version"].samples[0].value == 12
    assert families["pserver_training"].samples[0].value == 1
    assert families["pserver_eval_oa"].samples[0].value == 0.5
    assert str(families["pserver_eval_aa"].samples[0].value) == "nan"
    assert "pserver_eval_kappa" not in families and "pserver_epoch" not in families
    (sample,) = families["pserver_worker_staleness"].samples
    assert sample.labels["worker"] == 'a\\b"c\nd' and sample.value == 2
    assert families["pserver_worker_active"].samples[0].value == 0
    assert "pserver_worker_batch_share" not in families


def test_live_view_keeps_which_evaluations_scored_a_subset() -> None:
    view = LiveView([{"event": "start", "t": 0.0}])
    view(
        {"event": "eval", "t": 1.0, "version": 3, "oa": 0.95, "subset": True, "test_samples": 1072}
    )
    view(
        {"event": "eval", "t": 2.0, "version": 3, "oa": 0.94, "subset": False, "test_samples": 7130}
    )
    assert [(e["subset"], e["test_samples"]) for e in view.snapshot()["evals"]] == [
        (True, 1072),
        (False, 7130),
    ]
