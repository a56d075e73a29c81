"""``pslaunch compare`` run for real: compare.json, report.md and report.png, and an earlier
comparison refused unless ``--overwrite`` replaces it whole."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.data.convert.synth import synth_hsi
from launch.cli import main
from launch.report import RESULT_COLUMNS, SPEEDUP_COLUMNS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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
    assert set(ddp_summary) == set(ps_summary)  # the same summary.json contract
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
    assert results[0] == list(RESULT_COLUMNS)
    assert [row[0] for row in results[1:]] == ["equal-sync", "ddp"]
    idle = RESULT_COLUMNS.index("idle share")
    for row in results[1:]:
        assert len(row) == len(RESULT_COLUMNS) and row[1] == "1"
        for cell in row[2:idle] + row[idle + 1 :]:
            assert " / " not in cell and cell != "-", cell  # one repeat: one value, no "x / x / x"
    assert float(results[1][idle]) >= 0  # equal-sync measures its barrier
    assert results[2][idle] == "-"  # DDP's barrier is inside its all-reduce: not measured
    assert _table(markdown, "## Per-class accuracy")[0][0] == "mode"
    speedups = _table(markdown, "## Speed-up")
    assert speedups[0] == list(SPEEDUP_COLUMNS)
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
    earlier = {name: f"earlier {name}" for name in ("compare.json", "report.md", "timeline.png")}
    for name, text in earlier.items():
        (out / name).write_text(text)
    args = ["compare", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--modes"]
    args += ["equal-sync", "--slowdowns", "1", "--epochs", "1", "--no-progress", "--out", str(out)]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 1 and "holds an earlier comparison" in refused.output
    assert {name: (out / name).read_text() for name in earlier} == earlier
    # --overwrite: the run fails at once (no CUDA here), yet nothing of the earlier one stays.
    replaced = CliRunner().invoke(main, [*args, "--overwrite", "--devices", "cuda:0"])
    assert replaced.exit_code == 1 and "runs failed: equal-sync #1" in replaced.output
    assert json.loads((out / "compare.json").read_text())["runs"][0]["error"]
    assert not (out / "timeline.png").exists() and not (out / "runs" / "async-1").exists()
