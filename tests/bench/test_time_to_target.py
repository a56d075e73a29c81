"""The own-ground figures of the time-to-target bench, from runs made up by hand."""

from __future__ import annotations

from bench.harness.stats import paired, ratio
from bench.time_to_target import final_oa_diffs


def _run(mode: str, repeat: int, oa: float, epoch_s: float) -> dict:
    return {
        "mode": mode,
        "repeat": repeat,
        "epoch_time_s": epoch_s,
        "summary": {"final": {"oa": oa}},
    }


def test_ratios_pair_repeats_and_oa_is_compared_with_the_static_run_of_the_same_seed() -> None:
    static = [_run("weighted-sync", 1, 0.90, 2.0), _run("weighted-sync", 2, 0.80, 2.0)]
    left = [_run("weighted-sync", 1, 0.89, 3.0), _run("weighted-sync", 2, 0.83, 4.0)]
    left += [_run("ddp", 1, 0.5, 9.0), _run("ddp", 2, 0.5, 6.0), _run("ddp", 3, 0.5, 1.0)]
    left += [{"mode": "weighted-ddp", "repeat": 1, "error": "failed"}]
    epoch = ratio("epoch_time_s")
    assert paired(left, "weighted-sync", "ddp", epoch) == [3.0, 1.5]  # repeat 3 has no pair
    assert paired(left, "weighted-sync", "weighted-ddp", epoch) == []
    assert final_oa_diffs("leave_return_small", left, static) == [
        "final_oa_diff_leave_return_small_weighted_sync_vs_static=+0.0100"  # of -0.01 and +0.03
    ]
