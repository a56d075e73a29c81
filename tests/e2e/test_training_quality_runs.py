"""Training quality in a real run: a dataset with a three-sample epoch tail trains without a
collapse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.data.dataset import DatasetReader
from launch.compare import max_drop
from launch.local import LocalCluster, run_local


def test_a_dataset_with_a_three_sample_tail_trains_without_a_collapse(
    small_hsi: Path, tmp_path: Path
) -> None:
    with DatasetReader(small_hsi, cache_bytes=0) as reader:
        n = len(reader.train_indices)
    batch = next(b for b in range(24, 64) if n % b == 3)  # 143 = 5 x 28 + 3
    epochs = 5
    run_dir = tmp_path / "run"
    cluster = LocalCluster(
        dataset=small_hsi,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 2.0, 4.0),
        run_dir=run_dir,
        server_options=(
            *("--epochs", str(epochs), "--global-batch", str(batch), "--lr", "0.05"),
            *("--eval-every-updates", "2", "--workers", "3"),
        ),
        run_timeout_s=240.0,
    )
    try:
        summary = run_local(cluster)
    except Exception:
        print((run_dir / "cluster.log").read_text(errors="replace"))
        raise
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    events = [json.loads(line) for line in lines]
    rounds = [e for e in events if e["event"] == "round"]
    tails = [e for e in rounds if sum(w["batch"] for w in e["workers"]) < batch]
    assert len(tails) == epochs  # one tail round per epoch ...
    for event in rounds:
        samples = sum(w["batch"] for w in event["workers"])
        assert event["weight"] == pytest.approx(min(samples / batch, 1.0), abs=1e-6)
    assert all(e["weight"] == pytest.approx(3 / batch, abs=1e-6) for e in tails)  # ... at b / B
    done = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in done] == list(range(1, epochs + 1))
    assert all(e["exactly_once"] and e["samples"] == n for e in done)
    curve = [e for e in events if e["event"] == "eval"]
    drop = max_drop(curve, n)
    assert drop is not None and drop <= 0.10, [round(e["oa"], 3) for e in curve]
    assert summary["final"]["oa"] >= 0.8
