"""End-to-end: a user's own ``package.module:factory`` model trains through ``pslaunch local``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from common.data.convert.synth import synth_hsi
from launch.local import LocalCluster, run_local

USER_MODULE = '''
"""A user's model, outside the project: a linear classifier on the patch's mean spectrum."""

from torch import nn


class MeanSpectrum(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(in_channels, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.head(x.mean(dim=(2, 3)))


def build(in_channels, num_classes, input_size):
    return MeanSpectrum(in_channels, num_classes)
'''


def test_user_model_trains_through_pslaunch_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "user_models_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "spectral.py").write_text(USER_MODULE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)  # the server and worker subprocesses import it
    data = tmp_path / "tiny.h5"
    synth_hsi(data, samples=400, bands=8, size=24, classes=3, train_fraction=0.5, seed=1)
    model = "user_models_pkg.spectral:build"
    run_dir = tmp_path / "run"
    cluster = LocalCluster(
        dataset=data,
        model=model,
        mode="weighted-sync",
        slowdowns=(1.0, 1.0),
        run_dir=run_dir,
        server_options=("--epochs", "2", "--global-batch", "32", "--lr", "0.05"),
        worker_options=("--threads", "1"),
        run_timeout_s=240.0,
    )
    summary = run_local(cluster)
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["model"] == model and summary["model"] == model
    oa = written["final"]["oa"]
    assert isinstance(oa, float) and math.isfinite(oa) and 0.0 <= oa <= 1.0
    assert written["epochs"] == 2 and len(written["workers"]) == 2
    assert all(w["samples"] > 0 for w in written["workers"])
