"""``pserver evaluate-snapshots``: score a run's snapshots on the whole test split after training.

Each snapshot saved by ``--snapshot-every-updates`` is scored; the results go to
``RUN_DIR/snapshots.jsonl`` (one line per version, in version order) and the first version
whose OA reaches the target gives the time to target: the training time at which that
version was produced, so it is not limited to the evaluations made during the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from common.data.dataset import DatasetReader
from common.errors import ConfigError
from common.safefile import write_atomic
from common.training.evaluator import Evaluator
from common.training.models import build_model, check_allowed
from common.training.summary import SCORE_KEYS
from pserver.snapshots import snapshots as snap

log = logging.getLogger(__name__)

RESULTS = "snapshots.jsonl"


@dataclasses.dataclass(frozen=True)
class SnapshotEvalConfig:
    """What ``pserver evaluate-snapshots`` does.

    Attributes:
        run_dir: a run directory with ``snapshots/``.
        dataset: the dataset (default: the one ``snapshots/run.json`` names).
        target_oa: the target OA (default: the run's ``--target-oa`` from summary.json).
        batch: evaluation batch size.
        threads: torch CPU threads.
        progress: show a progress bar on stderr.
        allow_model: user models (``package.module:factory``) ``snapshots/run.json`` may name;
            any other is refused, since building it imports its module.
    """

    run_dir: Path
    dataset: Path | None = None
    target_oa: float | None = None
    batch: int = 512
    threads: int = 1
    progress: bool = True
    allow_model: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.target_oa is not None and not 0 < self.target_oa <= 1:
            raise ConfigError(f"--target-oa must be in (0, 1], got {self.target_oa}")
        if self.batch < 1 or self.threads < 1:
            raise ConfigError(
                f"--batch and --threads must be >= 1, got {self.batch}, {self.threads}"
            )


def first_reaching(rows: list[dict[str, Any]], target: float | None) -> dict[str, Any] | None:
    """The first row (in version order) whose OA is at least ``target``; None if none is."""
    if target is None:
        return None
    return next((r for r in sorted(rows, key=lambda r: r["version"]) if r["oa"] >= target), None)


def _run_target(run_dir: Path) -> float | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    target = summary.get("target_oa") if isinstance(summary, dict) else None
    return float(target) if isinstance(target, int | float) and 0 < target <= 1 else None


def _open_dataset(info: dict[str, Any], dataset: Path | None) -> DatasetReader:
    path = dataset if dataset is not None else Path(info["dataset"])
    if not path.is_file():
        raise ConfigError(
            f"the run's dataset {str(path)!r} is not there; give --dataset with the same file"
        )
    reader = DatasetReader(path)
    if reader.meta.fingerprint != info["fingerprint"]:
        reader.close()
        raise ConfigError(
            f"dataset {str(path)!r} is not the one the run trained on (fingerprint differs)"
        )
    return reader


def evaluate_snapshots(config: SnapshotEvalConfig) -> dict[str, Any]:
    """Score every snapshot of a run and write ``snapshots.jsonl``.

    Every file is checked before the first is scored, so a damaged one stops the command at
    once.

    Returns:
        ``{"rows", "target_oa", "first", "every", "path"}``: one row per snapshot
        (version, epoch, train_time_s, samples, final, oa, aa, kappa, loss), the target, the
        first row reaching it (or None) and the interval in updates.

    Raises:
        SnapshotError: the snapshot index or a snapshot file is missing or damaged.
        ConfigError, DatasetError, ModelError: the dataset or the model cannot be loaded.
    """
    directory = config.run_dir / snap.DIRECTORY
    info = snap.read_run_file(directory)
    found = snap.list_snapshots(directory)
    if not found:
        raise snap.SnapshotError(f"no snapshot files in {directory}")
    size = info["state_size"]
    check_allowed(info["model"], config.allow_model, f"{directory / snap.RUN_FILE}")
    metas = [snap.read(path, size, with_state=False)[0] for _, path in found]
    target = config.target_oa if config.target_oa is not None else _run_target(config.run_dir)
    torch.set_num_threads(config.threads)
    reader = _open_dataset(info, config.dataset)
    rows = []
    try:
        channels, height, _ = reader.meta.shape
        model = build_model(info["model"], channels, reader.meta.num_classes, height)
        evaluator = Evaluator(
            model, reader, num_classes=reader.meta.num_classes, batch=config.batch
        )
        if evaluator.layout.size != size:
            raise snap.SnapshotError(
                f"model {info['model']!r} has {evaluator.layout.size} values, the snapshots {size}"
            )
        bar = tqdm(found, desc="snapshots", unit="snap", disable=not config.progress)
        for (_, path), meta in zip(bar, metas, strict=True):
            _, state = snap.read(path, size)
            scores = evaluator.evaluate(state)
            rows.append({**dataclasses.asdict(meta), **{k: getattr(scores, k) for k in SCORE_KEYS}})
            bar.set_postfix_str(f"version {meta.version} OA {scores.oa:.4f}")
    finally:
        reader.close()
    out = config.run_dir / RESULTS
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    write_atomic(out, lambda handle: handle.write(text))
    first = first_reaching(rows, target)
    return {"rows": rows, "target_oa": target, "first": first, "every": info["every"], "path": out}


def describe(result: dict[str, Any]) -> str:
    """A line or two saying what the evaluation found."""
    rows, target, first = result["rows"], result["target_oa"], result["first"]
    best = max(rows, key=lambda r: r["oa"])
    lines = [
        f"scored {len(rows)} snapshots (every {result['every']} updates) on the whole test "
        f"split; wrote {result['path']}",
        f"best OA {best['oa']:.4f} at version {best['version']} "
        f"(training time {best['train_time_s']:.2f} s)",
    ]
    if target is None:
        lines.append("no target OA (give --target-oa)")
    elif first is None:
        lines.append(f"no snapshot reached OA {target:g}")
    else:
        lines.append(
            f"first version reaching OA {target:g}: {first['version']} (OA {first['oa']:.4f}) "
            f"at training time {first['train_time_s']:.2f} s"
        )
    return "\n".join(lines)


__all__ = ["SnapshotEvalConfig", "describe", "evaluate_snapshots", "first_reaching"]
