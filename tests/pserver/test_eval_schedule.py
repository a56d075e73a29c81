"""In-run evaluations: a warning at the first skip, a subset that fits, labels that place them."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from launch.progress import eval_label
from pserver.evaluation import MIN_AUTO_SUBSET, auto_subset_size
from tests.support.live import clients, live_server, poll_until_async


def test_auto_subset_fits_half_the_interval() -> None:
    # 4000 samples/s, a request every 1.5 s: half of it scores 3000 samples
    assert auto_subset_size(4000.0, 1.5, 8675) == 3000
    assert auto_subset_size(4000.0, 10.0, 8675) == 8675  # never more than the split
    assert auto_subset_size(10.0, 1.0, 8675) == MIN_AUTO_SUBSET  # never below the floor
    assert auto_subset_size(10.0, 1.0, 400) == 400


def test_eval_label_names_the_version_and_the_epochs_done() -> None:
    assert (
        eval_label({"version": 230, "epoch": 1, "epochs_done": 1.5}) == "version 230 (epoch 1.50)"
    )
    assert eval_label({"version": 7, "epoch": 2}) == "epoch 2 version 7"


async def test_evaluations_falling_behind_warn_once_with_the_remedy(
    small_hsi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pserver.evaluation")
    async with (
        live_server(
            small_hsi, mode="async", workers=1, global_batch=4, epochs=3, eval_every_updates=1
        ) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("fast")
        while task.action == "train":  # an update per push, far faster than an evaluation
            task = await client.push(member, task, np.full(ps.state_size, 1e-4, dtype=np.float32))
        await poll_until_async(
            lambda: ps.run.evals and ps.run.evals[-1].get("final"), 60, 0.01, "a final evaluation"
        )
    assert ps.evaluations.skipped > 0
    warnings = [r.getMessage() for r in caplog.records if "fell behind" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, when evaluations first fall behind
    assert "--eval-samples" in warnings[0]
    evals = [e for e in ps.log.events if e["event"] == "eval"]
    assert evals[-1]["final"] and evals[-1]["epochs_done"] == pytest.approx(3.0)
    done = [e["epochs_done"] for e in evals if not e["final"]]
    assert done == sorted(done) and len(set(done)) == len(done)  # each places its version


async def test_a_final_version_already_scored_in_run_is_recorded_as_final(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=1, epochs=100, eval_every_updates=1) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("fast")
        await client.push(member, task, np.full(ps.state_size, 1e-4, dtype=np.float32))
        await poll_until_async(lambda: ps.run.evals, 60, 0.01, "the in-run evaluation")
        ps.request_stop()
        await poll_until_async(
            lambda: ps.run.evals[-1].get("final"), 60, 0.01, "the final evaluation"
        )
    in_run, final = [e for e in ps.log.events if e["event"] == "eval"]
    assert (in_run["version"], in_run["final"], final["version"]) == (1, False, 1)
    assert final["oa"] == in_run["oa"] and final["test_samples"] == in_run["test_samples"]
    assert final["eval_s"] == 0  # the scores of the in-run evaluation, not scored twice


@pytest.mark.realdata
@pytest.mark.slow
async def test_skipping_moves_in_run_evaluations_to_a_subset(jasper_h5) -> None:
    async with (
        live_server(
            jasper_h5, mode="async", workers=1, global_batch=4, epochs=20, eval_every_updates=1,
            shutdown_timeout_s=60.0,
        ) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("fast")
        gradient = np.full(ps.state_size, 1e-4, dtype=np.float32)
        while task.action == "train":  # an update per push, far faster than an evaluation
            task = await client.push(member, task, gradient)
            if any(e["test_samples"] == MIN_AUTO_SUBSET for e in ps.run.evals):
                ps.request_stop()  # one in-run evaluation on the subset is enough
        await poll_until_async(
            lambda: ps.run.evals and ps.run.evals[-1].get("final"), 60, 0.01, "a final evaluation"
        )
    evals = [e for e in ps.log.events if e["event"] == "eval"]
    full = len(ps.reader.test_indices)
    assert ps.evaluations.skipped > 0 and evals[0]["test_samples"] == full
    assert len(evals) > 2  # in-run evaluations after the first fell behind score the subset
    assert [e["test_samples"] for e in evals[1:-1]] == [MIN_AUTO_SUBSET] * (len(evals) - 2)
    assert evals[-1]["test_samples"] == full  # the final evaluation scores all


def test_the_final_evaluation_wins_over_a_subset_one_of_the_same_version() -> None:
    from common.training.summary import final_eval, per_class_of

    subset = {"version": 9, "oa": 0.5, "accuracy": [0.5], "support": [10], "confusion": [[5]]}
    final = {"version": 9, "oa": 0.9, "accuracy": [0.9], "support": [99], "confusion": [[89]]}
    assert final_eval([subset, {**final, "final": True}])["oa"] == 0.9
    assert final_eval([{**final, "final": True}, subset])["oa"] == 0.9
    assert per_class_of([subset, {**final, "final": True}], ["a"])["support"] == [99]
    assert final_eval([]) is None


async def test_subset_scores_are_marked_and_the_best_whole_split_state_is_kept(
    small_hsi, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    from click.testing import CliRunner

    from pserver.checkpoint import BEST, read
    from pserver.cli import main

    caplog.set_level(logging.INFO, logger="pserver.server")
    async with (
        live_server(
            small_hsi, mode="async", workers=1, epochs=100, eval_every_updates=2,
            eval_samples=40, run_dir=tmp_path,
        ) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("fast")
        for _ in range(4):
            task = await client.push(member, task, np.full(ps.state_size, 1e-3, dtype=np.float32))
        await poll_until_async(lambda: len(ps.run.evals) >= 2, 60, 0.01, "in-run evaluations")
        ps.request_stop()
        await poll_until_async(lambda: ps.run.evals[-1].get("final"), 60, 0.01, "the final one")
    evals = [e for e in ps.log.events if e["event"] == "eval"]
    *in_run, final = evals
    assert all(e["subset"] and e["test_samples"] == 40 for e in in_run)
    assert final["subset"] is False and final["test_samples"] == len(ps.reader.test_indices)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("version ")]
    assert all(f"OA* {e['oa']:.4f} on 40 " in line for e, line in zip(in_run, lines, strict=False))
    assert f"): OA {final['oa']:.4f} AA" in lines[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_oa"] == final["oa"]  # subset scores never count as the best
    best = read(tmp_path / "checkpoints" / BEST)
    assert (best.meta["version"], best.meta["oa"]) == (final["version"], final["oa"])
    exported = CliRunner().invoke(
        main, ["export", str(tmp_path), "--best", "--out", str(tmp_path / "m.pt")]
    )
    assert exported.exit_code == 0, exported.output
    assert f"checkpoint version {final['version']}" in exported.output


async def test_the_best_checkpoint_is_replaced_only_by_a_better_oa(tmp_path) -> None:
    from pserver.checkpoint import BEST, BestCheckpoint, read

    best = BestCheckpoint(tmp_path, {"model": "m"}, write_timeout_s=10.0, resumed=False)
    for version, oa in ((1, 0.8), (2, 0.7), (3, 0.9), (4, 0.85)):
        await best.offer(version, np.full(3, version, dtype=np.float32), oa)
    kept = read(tmp_path / BEST)
    assert (kept.meta["version"], kept.meta["oa"], kept.arrays["state"][0]) == (3, 0.9, 3.0)
    resumed = BestCheckpoint(tmp_path, {"model": "m"}, write_timeout_s=10.0, resumed=True)
    await resumed.offer(5, np.zeros(3, dtype=np.float32), 0.88)
    assert read(tmp_path / BEST).meta["version"] == 3  # a resumed run keeps the best it had
