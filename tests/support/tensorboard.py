"""TensorBoard event files of a run, read back by TensorBoard itself."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.training.tbsink import SUBDIR


def scalars(run_dir: Path) -> dict[str, list]:
    """Every scalar series under the run's TensorBoard folder, read by TensorBoard itself."""
    acc = EventAccumulator(str(run_dir / SUBDIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
