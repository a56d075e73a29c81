"""The file contracts of GUIDE section 3, as the tests check them."""

from __future__ import annotations

SUMMARY_KEYS = {
    "mode",
    "model",
    "dataset",
    "wall_time_s",
    "train_time_s",
    "steps",
    "epochs",
    "samples_seen",
    "final",
    "best_oa",
    "target_oa",
    "time_to_target_s",
    "workers",
    "staleness",
    "idle_share",
}
EVAL_KEYS = {"event", "t", "version", "epoch", "samples", "oa", "aa", "kappa", "loss"}
