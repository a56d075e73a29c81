"""``pslaunch compare``: runs, compare.json, report.md and report.png; report arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import ConfigError
from launch.cluster.spec import PRESETS, parse_cluster
from launch.compare import CompareConfig, eval_curve, time_to_target
from launch.report import aggregate, render_markdown, speedup
from launch.settings import TrainSettings


def _fake_run(
    mode: str, repeat: int, epoch_s: float, oa: float, target_s: float | None, idle: float | None
) -> dict:
    summary = {"final": {"oa": oa, "aa": oa - 0.1, "kappa": oa - 0.2}, "idle_share": idle}
    return {
        "mode": mode,
        "repeat": repeat,
        "epoch_time_s": epoch_s,
        "time_to_target_s": target_s,
        "curve": [],
        "summary": summary,
    }


def _settings() -> dict:
    return {
        "modes": ["weighted-sync", "ddp"],
        "target_oa": 0.8,
        "slowdowns": [1.0, 3.0],
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
    }


def test_aggregate_and_speedups_by_hand() -> None:
    data = {
        "settings": _settings(),
        "runs": [
            _fake_run("weighted-sync", 1, 1.0, 0.90, 2.0, 0.05),
            _fake_run("weighted-sync", 2, 3.0, 0.80, None, 0.2),
            _fake_run("weighted-sync", 3, 2.0, 0.85, 4.0, 0.1),
            _fake_run("ddp", 1, 4.0, 0.88, 6.0, None),
            {"mode": "ddp", "repeat": 2, "error": "rank 1 exited with code 1"},
        ],
    }
    stats = aggregate(data)
    assert stats["weighted-sync"]["epoch_time_s"] == (1.0, 2.0, 3.0)
    assert stats["weighted-sync"]["time_to_target_s"] == (2.0, 3.0, 4.0)
    assert stats["weighted-sync"]["reached"] == 2 and stats["weighted-sync"]["runs"] == 3
    assert stats["weighted-sync"]["oa"] == pytest.approx((0.80, 0.85, 0.90))
    assert stats["ddp"]["runs"] == 1 and stats["ddp"]["failed"] == 1
    assert stats["weighted-sync"]["idle_share"] == (0.05, 0.1, 0.2)
    assert stats["ddp"]["idle_share"] is None
    assert speedup(stats, "weighted-sync", "ddp", "epoch_time_s") == pytest.approx(2.0)
    assert speedup(stats, "weighted-sync", "ddp", "time_to_target_s") == pytest.approx(2.0)
    assert speedup(stats, "weighted-sync", "equal-sync", "epoch_time_s") is None
    markdown = render_markdown(data)
    assert "(2/3 reached)" in markdown and "1 (1 failed)" in markdown
    assert "| 0.050 / 0.100 / 0.200 |" in markdown
    assert "- cluster: none emulated" in markdown and "oversubscribed" in markdown
    emulated = parse_cluster(2, node_cpus="0.6,0.2", server_cpus=0.5)
    assert emulated is not None
    data["settings"]["cluster"] = emulated.describe()
    assert "- emulated cluster: workers 0.6/0.2 cores, server 0.5" in render_markdown(data)
    data["settings"]["cluster"] = PRESETS["small-1124"].spec("small-1124").describe()
    markdown = render_markdown(data)
    assert "- emulated cluster: small-1124: workers 0.4/0.4/0.2/0.1 cores, server 0.5" in markdown
    assert PRESETS["small-1124"].description in markdown  # a preset is printed in full
    assert "extra worker join options" not in markdown
    data["settings"]["worker_options"] = ["--data", "copy.h5"]
    markdown = render_markdown(data)
    assert "- extra worker join options (parameter-server runs): `--data copy.h5`" in markdown
    assert "group 2" not in markdown and "ddp-kept" not in markdown
    data["settings"]["modes"].append("ddp-kept")
    for repeat, (count, lost, seconds) in enumerate(((2, 300, 20.0), (2, 100, 30.0)), 1):
        run = _fake_run("ddp-kept", repeat, 4.0, 0.88, 6.0, None)
        run["summary"].update(restarts=count, lost_samples=lost, restart_s=seconds)
        data["runs"].append({**run, "kept_nodes": [0, 2]})
    markdown = render_markdown(data)
    assert "weighted-sync run: repeat 1: 0, 2; repeat 2: 0, 2" in markdown
    kept_row = next(row for row in markdown.splitlines() if row.startswith("| ddp-kept |"))
    assert "| group 4, samples lost 400, 50.0 s |" in kept_row  # summed over the repeats


def test_time_to_target_takes_the_first_crossing() -> None:
    curve = [
        {"time_s": 1.0, "samples": 10, "oa": 0.5},
        {"time_s": 2.0, "samples": 20, "oa": 0.81},
        {"time_s": 3.0, "samples": 30, "oa": 0.7},
    ]
    assert time_to_target(curve, 0.8) == 2.0
    assert time_to_target(curve, 0.9) is None
    assert time_to_target(curve, None) is None


def test_eval_curve_has_one_point_per_version_with_the_final_scores(tmp_path: Path) -> None:
    def ev(version: int, oa: float, **extra: object) -> dict:
        return {"event": "eval", "t": 1.0 + version, "version": version, "samples": 10 * version,
                "train_t": float(version), "oa": oa, "aa": oa, "kappa": oa, **extra}  # fmt: skip

    events = [{"event": "train_start", "t": 0.5}, ev(1, 0.5), ev(2, 0.6), ev(2, 0.7, final=True)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    curve = eval_curve(tmp_path)
    assert [p["samples"] for p in curve] == [10, 20] and curve[-1]["oa"] == 0.7


def test_ddp_kept_follows_weighted_sync_and_keeps_the_nodes_with_five_percent(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d.h5"
    data.touch()

    def config(modes: tuple[str, ...]) -> CompareConfig:
        settings = TrainSettings(epochs=1)
        return CompareConfig(data, "hsi-cnn", modes, (1.0, 2.0, 4.0), tmp_path / "o", settings)

    for modes in (("ddp-kept",), ("ddp-kept", "weighted-sync")):
        with pytest.raises(ConfigError, match="list weighted-sync before it"):
            config(modes).validate()
    compare = config(("weighted-sync", "ddp-kept", "weighted-ddp")).validate()

    def summary(slowest: int) -> dict:  # samples in the order the server lists workers
        workers = [("w2-x4", slowest), ("w0-x1", 59), ("w1-x2", 36)]
        return {"workers": [{"name": n, "samples": s} for n, s in workers]}

    assert compare.kept_nodes(summary(4)) == [0, 1]  # 4 of 99 samples: under 5 %
    assert compare.kept_nodes(summary(5)) == [0, 1, 2]  # 5 of 100
    kept = compare.ddp("ddp-kept", tmp_path / "r", [0, 2]).validate()
    assert (kept.slowdowns, kept.names, kept.weighted) == ((1.0, 4.0), ("r0-x1", "r2-x4"), False)
    assert compare.ddp("weighted-ddp", tmp_path / "r").validate().mode == "weighted-ddp"


def test_the_report_gives_median_rounds_and_flags_a_figure_carried_by_a_few_rounds(
    tmp_path: Path,
) -> None:
    from launch.compare import run_record

    steady = [0.055] * 63
    runs = {"equal-sync": [*steady, 0.0575], "weighted-sync": [*steady[:-1], 0.0576, 1.35]}
    data = {"settings": {**_settings(), "modes": list(runs)}, "runs": []}
    for mode, times in runs.items():
        run_dir = tmp_path / mode
        run_dir.mkdir()
        events = [{"event": "round", "t": i, "round_s": s} for i, s in enumerate(times)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        summary = {"train_time_s": sum(times), "epochs": 1, "final": None}
        data["runs"].append(run_record(mode, 1, run_dir, summary, None))
    ws = data["runs"][1]
    assert ws["round_median_s"] == pytest.approx(0.055)
    assert ws["tail_share"] == pytest.approx((1.35 + 0.0576) / sum(runs["weighted-sync"]))
    assert data["runs"][0]["tail_share"] < 0.2
    markdown = render_markdown(data)
    header, *rows = [line for line in markdown.splitlines() if line.startswith("| ")][:3]
    assert "| median round ms |" in header
    assert rows[0].startswith("| equal-sync | 1 | 3.523 | 55.0 |")
    assert rows[1].startswith("| weighted-sync | 1 | 4.818 † | 55.0 |")
    assert (
        "† carried by a few rounds: the slowest 2 % of the rounds made more than 20 % of the "
        "round time in weighted-sync #1 (29 %, the longest round 1350 ms against a median of "
        "55.0 ms)"
    ) in markdown
