"""docs/tutorial.md runs as written: its ```bash tutorial blocks, in order, on Jasper Ridge."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.data.dataset import DatasetReader
from tests.support.paths import ROOT

TUTORIAL = ROOT / "docs" / "tutorial.md"
BLOCK = re.compile(r"^```bash tutorial\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TIMEOUT_S = 540  # about a minute on two quiet cores; far more when other jobs share them


def tutorial_script(text: str) -> str:
    """The tutorial's runnable blocks as one bash script that stops at the first failure."""
    blocks = BLOCK.findall(text)
    return "set -euo pipefail\n" + "\n".join(blocks)


def test_tutorial_marks_its_steps() -> None:
    blocks = BLOCK.findall(TUTORIAL.read_text(encoding="utf-8"))
    commands = " ".join(blocks)
    for step in ("data prepare hsi", "pslaunch local", "pslaunch compare", "export", "predict"):
        assert step in commands, f"the tutorial's runnable blocks lack {step!r}"


def test_the_sample_output_agrees_with_the_tutorials_own_dataset() -> None:
    """The results table shown is that of the dataset ``data info`` shows: epochs x ceil(train
    / B) updates, and the workers' samples add up to epochs x train."""
    text = TUTORIAL.read_text(encoding="utf-8")
    train = int(re.search(r"samples: +\d+ \(train (\d+), test \d+\)", text).group(1))
    command = re.search(r"pslaunch local .*?--epochs (\d+)", text, re.DOTALL)
    epochs = int(command.group(1))
    row = re.search(r"^weighted-sync +(\d+) +(\d+) ", text, re.MULTILINE)
    assert (int(row.group(1)), int(row.group(2))) == (epochs, epochs * -(-train // 64))
    samples = [int(m) for m in re.findall(r"^w\d-x\d +x\d +\d+ +(\d+) ", text, re.MULTILINE)]
    assert len(samples) == 2 and sum(samples) == epochs * train


@pytest.mark.realdata
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_tutorial_runs_end_to_end(jasper_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("JasperRidge.mat", "JasperRidge_gt.mat"):
        (data / name).symlink_to(jasper_dir / name)
    script = tmp_path / "tutorial.sh"
    script.write_text(tutorial_script(TUTORIAL.read_text(encoding="utf-8")), encoding="utf-8")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"

    summary = json.loads((tmp_path / "runs/tutorial/summary.json").read_text())
    assert summary["mode"] == "weighted-sync" and summary["epochs"] == 4
    assert sorted(w["slowdown"] for w in summary["workers"]) == [1.0, 3.0]
    reader = DatasetReader(tmp_path / "jasper.h5")
    train = reader.meta.train_count
    reader.close()
    assert sum(w["samples"] for w in summary["workers"]) == summary["samples_seen"] == 4 * train
    assert "after 4.00 epochs" in done.stdout  # the metrics block printed the evaluations

    compare = json.loads((tmp_path / "runs/compare/compare.json").read_text())
    assert sorted(r["mode"] for r in compare["runs"] if "error" not in r) == [
        "equal-sync",
        "weighted-sync",
    ]
    for figure in ("report.md", "report.png", "timeline.png"):
        assert (tmp_path / "runs/compare" / figure).stat().st_size > 0

    scores = json.loads((tmp_path / "jasper_map.json").read_text())
    assert scores["oa"] > 0.8, scores
    labels = np.load(tmp_path / "jasper_map.npy")
    assert labels.shape == (100, 100) and set(np.unique(labels)) <= {0, 1, 2, 3}
    assert (tmp_path / "jasper_map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
