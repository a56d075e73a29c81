"""``pslaunch compare`` run for real: compare.json, report.md and report.png, and an earlier
comparison refused unless ``--overwrite`` replaces it whole."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.data.convert.synth import synth_hsi
from common.polling import poll_until
from launch.cli import main
from launch.compare import KEPT_SHARE, CompareConfig
from launch.report import RESULT_COLUMNS
from launch.settings import TrainSettings
from tests.support.launches import start_pslaunch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WAIT_S = 300.0


def _table(markdown: str, heading: str) -> list[list[str]]:
    """The rows (header first, rule dropped) of the Markdown table under ``heading``."""
    lines = markdown.split(heading, 1)[1].splitlines()[1:]  # below the heading line
    block = []
    for line in lines[1:] if not lines[0] else lines:
        if not line.startswith("|"):
            break
        block.append(line)
    assert len(block) >= 3 and set(block[1]) <= {"|", "-"}, block
    return [[c.strip() for c in line.strip("|").split("|")] for line in block[:1] + block[2:]]


def test_compare_two_modes_writes_the_report(tmp_path: Path) -> None:
    data = tmp_path / "hsi.h5"
    synth_hsi(data, samples=400, bands=16, size=32, classes=4, train_fraction=0.3, seed=4)
    out = tmp_path / "cmp"
    result = CliRunner().invoke(
        main,
        [
            "compare",
            "--dataset",
            str(data),
            "--model",
            "hsi-cnn",
            "--modes",
            "equal-sync,ddp",
            "--slowdowns",
            "1,2",
            "--epochs",
            "3",
            "--global-batch",
            "32",
            "--target-oa",
            "0.3",
            "--repeats",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "compare.json").read_text())
    assert report["settings"]["modes"] == ["equal-sync", "ddp"]
    assert report["settings"]["slowdowns"] == [1.0, 2.0]
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"equal-sync", "ddp"} and len(report["runs"]) == 2
    ps_summary = json.loads((Path(runs["equal-sync"]["run_dir"]) / "summary.json").read_text())
    ddp_summary = json.loads((Path(runs["ddp"]["run_dir"]) / "summary.json").read_text())
    # The same summary.json contract; each launcher adds its own restart details.
    assert set(ddp_summary) - {"lost_samples", "restart_s"} == set(ps_summary) - {
        "worker_restarts",
        "versions_replayed",
    }
    assert ddp_summary["restarts"] == ps_summary["restarts"] == 0
    assert ddp_summary["per_class"]["support"] == ps_summary["per_class"]["support"]
    for mode, run in runs.items():
        summary = run["summary"]
        assert summary["mode"] == mode and summary["epochs"] == 3
        assert run["epoch_time_s"] == pytest.approx(summary["train_time_s"] / 3)
        samples = [p["samples"] for p in run["curve"]]  # the server skips superseded versions
        assert samples == sorted(set(samples)) and samples[-1] == 360, samples
        assert run["time_to_target_s"] is not None  # a target of 0.3 is met after one epoch
        assert run["time_to_target_s"] <= summary["train_time_s"]
    # Same seed, split, initialisation and equal batches: DDP and equal-sync learn alike.
    assert ddp_summary["samples_seen"] == ps_summary["samples_seen"] == 360
    assert abs(ddp_summary["final"]["oa"] - ps_summary["final"]["oa"]) < 0.03

    markdown = (out / "report.md").read_text()
    assert markdown.strip() in result.output  # the CLI prints the report
    results = _table(markdown, "## Results")
    columns = [c for c in RESULT_COLUMNS if c != "restarts"]  # none restarted: no column
    assert results[0] == columns
    assert [row[0] for row in results[1:]] == ["equal-sync", "ddp"]
    idle = columns.index("idle share")
    for row in results[1:]:
        assert len(row) == len(columns) and row[1] == "1"
        for cell in row[2:idle] + row[idle + 1 :]:
            assert " / " not in cell and cell != "-", cell  # one repeat: one value, no "x / x / x"
    assert float(results[1][idle]) >= 0  # equal-sync measures its barrier
    assert results[2][idle] == "-"  # DDP's barrier is inside its all-reduce: not measured
    assert _table(markdown, "## Per-class accuracy")[0][0] == "mode"
    speedups = _table(markdown, "## Speed-up")
    assert speedups[0] == [
        "mode",
        "epoch time vs ddp",
        "epoch time vs equal-sync",
        "time to target vs ddp",
        "time to target vs equal-sync",
    ]
    assert speedups[2][:2] == ["ddp", "1.00x"]  # ddp against itself
    assert "## Setup" in markdown and "workers' devices: cpu: " in markdown
    assert f"workers' hosts: `{socket.gethostname()}`: " in markdown  # where each joined from
    assert "max steps" not in markdown  # only the limits that were given
    assert f"report: {out / 'report.md'}" in result.output  # where the files are, at the end
    png = (out / "report.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


def test_an_earlier_comparison_is_refused_unless_overwrite_replaces_it_whole(
    small_hsi: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmp"
    (out / "runs" / "async-1").mkdir(parents=True)
    (out / "runs" / "async-1" / "metrics.jsonl").write_text('{"event": "push"}\n')
    earlier = {name: f"earlier {name}" for name in ("compare.json", "report.md", "timeline.png")}
    for name, text in earlier.items():
        (out / name).write_text(text)
    args = ["compare", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--modes"]
    args += ["ddp,equal-sync", "--slowdowns", "1", "--epochs", "1", "--no-progress"]
    args += ["--out", str(out)]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 1 and "holds an earlier comparison (runs async-1)" in refused.output
    assert {name: (out / name).read_text() for name in earlier} == earlier
    # --overwrite: the first run cannot start (no CUDA here): the comparison stops with its
    # error, runs nothing more, writes no report, and nothing of the earlier one stays
    replaced = CliRunner().invoke(main, [*args, "--overwrite", "--devices", "cuda:0"])
    assert replaced.exit_code == 1
    assert "Error: ddp #1/1 could not start: DDP rank r0-x1 exited with code 1: " in (
        replaced.output
    )
    assert "CUDA" in replaced.output
    assert sorted(p.name for p in out.iterdir()) == ["runs"]
    assert [p.name for p in (out / "runs").iterdir()] == ["ddp-1"]
    assert "Traceback" not in (out / "runs" / "ddp-1" / "cluster.log").read_text()
    # what the failed start left is no comparison: the corrected command is not refused
    CompareConfig(
        dataset=small_hsi,
        model="hsi-cnn",
        modes=("equal-sync",),
        slowdowns=(1.0,),
        out=out,
        train=TrainSettings(epochs=1),
    ).validate()


def test_ctrl_c_keeps_a_report_of_the_finished_runs_and_resume_runs_the_rest(
    small_hsi: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--slowdowns", "1"]
    args += ["--modes", "equal-sync", "--repeats", "2", "--no-progress", "--out", str(out)]
    second = out / "runs" / "equal-sync-2" / "metrics.jsonl"
    launcher = start_pslaunch(*args, "--epochs", "4")
    try:
        poll_until(
            lambda: (
                (second.exists() and '"round"' in second.read_text()) or launcher.code is not None
            ),
            WAIT_S,
            0.2,
            "the second run's training",
        )
        launcher.signal_group(signal.SIGINT)  # Ctrl-C in the terminal
        assert launcher.wait(WAIT_S) == 130, launcher.output()
    finally:
        launcher.kill()
    assert "compare: stopped after 1 of 2 runs; report.md covers those" in launcher.output()
    data = json.loads((out / "compare.json").read_text())
    assert [r["repeat"] for r in data["runs"]] == [1] and "error" not in data["runs"][0]
    assert "**stopped after 1 of 2 runs**" in (out / "report.md").read_text()
    refused = CliRunner().invoke(main, [*args, "--epochs", "4"])
    assert "holds an earlier comparison (runs equal-sync-1, equal-sync-2)" in refused.output
    other = CliRunner().invoke(main, [*args, "--epochs", "3", "--resume"])
    assert other.exit_code == 1 and "made with other settings (train)" in other.output
    first = (out / "runs" / "equal-sync-1" / "summary.json").read_bytes()
    resumed = CliRunner().invoke(main, [*args, "--epochs", "4", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    data = json.loads((out / "compare.json").read_text())
    assert sorted(r["repeat"] for r in data["runs"]) == [1, 2]
    assert all("error" not in r for r in data["runs"])
    assert "stopped" not in data and "stopped" not in (out / "report.md").read_text()
    assert (out / "runs" / "equal-sync-1" / "summary.json").read_bytes() == first  # kept


@pytest.mark.exclusive  # shares follow speeds
def test_ddp_kept_runs_plain_ddp_on_the_nodes_weighted_sync_kept(tmp_path: Path) -> None:
    data = tmp_path / "hsi.h5"
    synth_hsi(data, samples=300, bands=8, size=24, classes=3, train_fraction=0.3, seed=4)
    out = tmp_path / "cmp"
    args = ["compare", "--dataset", str(data), "--model", "hsi-cnn", "--slowdowns", "1,1,40"]
    args += ["--modes", "weighted-sync,ddp-kept,weighted-ddp", "--epochs", "2"]
    args += ["--global-batch", "32", "--no-progress", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    runs = {r["mode"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    samples = {w["name"]: w["samples"] for w in runs["weighted-sync"]["summary"]["workers"]}
    assert samples["w2-x40"] < KEPT_SHARE * sum(samples.values())  # the 40x slower worker sat out
    # On two busy cores one fast worker can do as well as two, so the planner may sit either
    # out as well: ddp-kept runs on exactly the nodes weighted-sync gave a share of samples.
    names = ["w0-x1", "w1-x1", "w2-x40"]
    shared = [i for i, n in enumerate(names) if samples[n] >= KEPT_SHARE * sum(samples.values())]
    kept = runs["ddp-kept"]
    assert kept["kept_nodes"] == shared and 2 not in shared and kept["summary"]["mode"] == "ddp"
    ranks = [w["name"] for w in kept["summary"]["workers"]]
    assert ranks == [f"r{i}-x1" for i in shared]  # ranks keep their node's name
    weighted = runs["weighted-ddp"]["summary"]
    assert weighted["mode"] == "weighted-ddp" and len(weighted["workers"]) == 3
    assert weighted["workers"][2]["samples"] < weighted["workers"][0]["samples"] / 10
    assert all(
        r["summary"]["samples_seen"] == kept["summary"]["samples_seen"] for r in runs.values()
    )
    markdown = (out / "report.md").read_text()
    assert [row[0] for row in _table(markdown, "## Results")[1:]] == list(runs)
    assert f"same repeat's weighted-sync run: repeat 1: {', '.join(map(str, shared))}" in markdown
    assert "epoch time vs weighted-ddp" in markdown
