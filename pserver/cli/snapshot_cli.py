"""``pserver evaluate-snapshots``: the command line of ``pserver.snapshots.snapshot_eval``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from common.errors import PSError
from pserver.cli.model_cli import allow_model_option, file_option


@click.command("evaluate-snapshots")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--target-oa",
    type=float,
    default=None,
    help="Report the first version reaching this test OA (default: the run's --target-oa).",
)
@file_option(
    "--dataset", "The run's dataset file (default: the one RUN_DIR/snapshots/run.json names)."
)
@click.option("--batch", type=int, default=512, help="Evaluation batch size.")
@click.option("--threads", type=int, default=1, help="Torch CPU threads.")
@click.option("--progress/--no-progress", default=True, help="Progress bar.")
@allow_model_option("RUN_DIR/snapshots/run.json")
def evaluate_snapshots_cmd(**options: Any) -> None:
    """Score every snapshot in RUN_DIR/snapshots on the whole test split after training.

    Writes RUN_DIR/snapshots.jsonl (version, epoch, train_time_s, samples, final, oa, aa,
    kappa, loss) and prints the first version reaching the target and its training time.
    """
    from pserver.snapshots.snapshot_eval import SnapshotEvalConfig, describe, evaluate_snapshots

    try:
        result = evaluate_snapshots(SnapshotEvalConfig(**options))
    except PSError as exc:
        raise click.ClickException(str(exc).strip().splitlines()[0]) from exc
    click.echo(describe(result))
