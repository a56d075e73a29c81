"""Reports fit for a paper: a setup block, throughput, only fillable tables, sorted rows, paths."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt

from common.training.tables import files_written, natural_key, summary_tables
from launch.cluster.spec import ClusterSpec, parse_cluster
from launch.compare import collect_setup
from launch.figures import _draw_timeline
from launch.report import render_markdown, setup_section, worker_values


def _run(mode: str, oa: float, run_dir: Path | None = None) -> dict:
    summary = {
        "final": {"oa": oa, "aa": oa - 0.1, "kappa": oa - 0.2},
        "idle_share": None,
        "samples_seen": 1200,
        "train_time_s": 4.0,
    }
    run = {
        "mode": mode,
        "repeat": 1,
        "epoch_time_s": 2.0,
        "time_to_target_s": None,
        "curve": [],
        "summary": summary,
    }
    if run_dir is not None:
        run["run_dir"] = str(run_dir)
    return run


def _data(modes: list[str], runs: list[dict], **settings: object) -> dict:
    base = {
        "modes": modes,
        "target_oa": None,
        "slowdowns": [1.0, 2.0],
        "slowdown_schedules": [],
        "dataset": "d.h5",
        "model": "hsi-cnn",
        "repeats": 1,
        "train": {
            "global_batch": 64,
            "optimizer": "sgd",
            "lr": 0.05,
            "lr_schedule": "cosine",
            "epochs": 2,
            "max_steps": None,
            "seed": 0,
        },
    }
    return {"settings": {**base, **settings}, "runs": runs}


def test_one_repeat_without_baselines_fills_only_what_it_can(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    joins = [
        {"event": "join", "t": 0.1, "worker": "w10-x2", "device": "cpu", "slowdown": 2,
         "host": "node-b`\n| x"},
        {"event": "join", "t": 0.2, "worker": "w2-x1", "device": "cuda:0", "slowdown": 1,
         "host": "node-a"},
        {"event": "join", "t": 0.3, "worker": "w3-x1", "device": "cuda:0", "slowdown": 1,
         "host": "node-a"},
        {"event": "join", "t": 0.4, "worker": "rank0", "device": "cpu", "slowdown": 1},
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in joins))
    setup = {"host": "n1", "cpu": "Some CPU", "cpus": 2, "gpus": [], "torch": "2.x",
             "python": "3.12", "os": "Linux"}  # fmt: skip
    cluster = parse_cluster(2, node_cpus="0.4,0.1", links="1gbit").describe()
    data = _data(
        ["weighted-sync", "async"],
        [_run("weighted-sync", 0.851, run_dir), _run("async", 0.84)],
        setup=setup,
        cluster=cluster,
    )
    markdown = render_markdown(data)
    assert "0.851 / 0.851 / 0.851" not in markdown and "| 0.8510 |" in markdown
    assert "max steps" not in markdown and "epochs 2" in markdown
    assert "No baseline ran (ddp or equal-sync)" in markdown
    header = next(line for line in markdown.splitlines() if line.startswith("| mode | runs"))
    assert "throughput samples/s" in header and "| 300 |" in markdown  # 1200 samples / 4 s
    assert "time to target" not in header and "idle share" not in header  # nothing to fill
    assert "- host: `n1` (Linux); CPU: Some CPU, 2 logical CPUs usable; GPUs: none" in markdown
    assert "- workers' devices: cpu: rank0, w10-x2; cuda:0: w2-x1, w3-x1" in markdown
    assert "- workers' hosts: `node-a`: w2-x1, w3-x1; `node-b x`: w10-x2\n" in markdown
    assert markdown.count("emulated cluster:") == 1
    assert "- emulated cluster: " + ClusterSpec.from_description(cluster).summary_line() in markdown


def test_the_restarts_column_shows_only_when_a_run_restarted() -> None:
    runs = [_run("weighted-sync", 0.85), _run("async", 0.84)]
    header = next(line for line in render_markdown(_data(["weighted-sync", "async"], runs))
                  .splitlines() if line.startswith("| mode"))  # fmt: skip
    assert "restarts" not in header
    runs[1]["summary"].update(restarts=2, worker_restarts=1, versions_replayed=17)
    markdown = render_markdown(_data(["weighted-sync", "async"], runs))
    assert "| restarts |" in markdown
    assert "| server 2, workers 1, versions replayed 17 |" in markdown


def test_setup_and_devices_helpers(tmp_path: Path) -> None:
    setup = collect_setup()
    assert setup["cpus"] >= 1 and setup["torch"] and setup["cpu"]
    assert sorted(["w10", "w2", "w1"], key=natural_key) == ["w1", "w2", "w10"]
    assert worker_values([tmp_path / "missing"], "device", "?") == {}
    lines = setup_section({"settings": {"setup": setup}, "runs": []})
    assert any(line.startswith("- torch ") for line in lines)
    assert setup_section({"settings": {"setup": None}, "runs": []}) == []
    text = files_written(tmp_path, {"markdown": str(tmp_path / "report.md")})
    assert text.splitlines() == [
        f"results: {tmp_path / 'compare.json'}",
        f"runs: {tmp_path / 'runs'}/<mode>-<repeat>",
        f"report: {tmp_path / 'report.md'}",
    ]


def test_timeline_and_worker_rows_are_sorted_by_name() -> None:
    def part(name: str) -> dict:
        return {"worker": name, "batch": 8, "compute_s": 0.01, "idle_s": 0.0,
                "transfer_s": 0.001, "actual_s": 0.011}  # fmt: skip

    rounds = [{"t": 1.0, "round_s": 0.02, "round": 1,
               "workers": [part("w10-x4"), part("w2-x2"), part("w1-x1")]}]  # fmt: skip
    fig, axis = plt.subplots()
    try:
        _draw_timeline(axis, rounds, set())
        assert [t.get_text() for t in axis.get_yticklabels()] == ["w1-x1", "w2-x2", "w10-x4"]
    finally:
        plt.close(fig)
    workers = [
        {"name": n, "slowdown": 1.0, "speed": 10.0, "samples": 5, "pushes": 1}
        for n in ("w10-x1", "w2-x1")
    ]
    summary = {"mode": "async", "epochs": 1, "steps": 2, "train_time_s": 1.0,
               "final": {}, "workers": workers}  # fmt: skip
    table = summary_tables(summary)
    assert table.index("w2-x1") < table.index("w10-x1")


def test_names_and_devices_from_run_files_reach_the_report_as_plain_text(tmp_path: Path) -> None:
    """A join event naming a worker (or device) with a newline and HTML, as a run file from
    elsewhere may, adds no heading, no table row and no markup to the report."""
    hostile = "w4\n# Pwned <img src=x onerror=alert(1)> | x"
    join = {"event": "join", "t": 0.1, "worker": hostile, "device": "cpu\n## <b>", "host": "h"}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(join) + "\n")
    section = setup_section({"settings": {}, "runs": [{"run_dir": str(tmp_path)}]})
    assert section[:2] == ["## Setup", ""] and section[-1] == ""
    lines = section[2:-1]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    text = "\n".join(lines)
    assert "<" not in text and "|" not in text and "&lt;img src=x" in text
