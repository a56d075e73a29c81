"""Short real training runs shared by the output tests (server and worker processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launch.local import LocalCluster, run_local


def train(
    dataset: Path, run_dir: Path, model: str, epochs: int, workers: int = 2
) -> dict[str, Any]:
    """Train ``model`` in weighted-sync mode on 127.0.0.1; print the cluster log on failure.

    Returns:
        The run's summary.
    """
    cluster = LocalCluster(
        dataset=dataset,
        model=model,
        mode="weighted-sync",
        slowdowns=(1.0,) * workers,
        run_dir=run_dir,
        server_options=("--epochs", str(epochs), "--lr", "0.05", "--lr-schedule", "cosine"),
        run_timeout_s=240.0,
    )
    try:
        return run_local(cluster)
    except Exception:
        log = run_dir / "cluster.log"
        print(log.read_text() if log.is_file() else "no cluster.log")
        raise
