"""Why a run ended is a ``FinishReason`` everywhere: no code tells run endings apart by
comparing or cutting text."""

from __future__ import annotations

import re
from pathlib import Path

from common.protocol.ending import FinishReason, RunEnded

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("common", "pserver", "worker", "launch")
VALUES = "|".join(reason.value for reason in FinishReason)
# An exception's text compared or cut; a reason's value, a "failed: ..." text or an ending
# constant compared, searched or cut.
MATCHING = re.compile(
    r"str\(\w+\)\s*(==|!=|\.startswith|\.endswith|\.removeprefix)"
    rf"|(==|!=|\bin|startswith\(|endswith\(|removeprefix\()\s*[\"']({VALUES})\b"
    r"|(==|!=|startswith\(|endswith\(|removeprefix\()\s*[\"']failed: "
    r"|(==|!=|startswith\(|endswith\(|removeprefix\()\s*(TRAINING_ENDED|RUN_FAILED|FAILED_PREFIX"
    r"|INTERRUPTED)\b"
    r"|\b(TRAINING_ENDED|RUN_FAILED|FAILED_PREFIX)\s*(==|!=|in\b)"
)


def _matches(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MATCHING.search(line)]


def test_the_check_finds_reasons_matched_by_text() -> None:
    caught = [
        "if isinstance(exc, ServerLost) and str(exc) == TRAINING_ENDED:",
        "if str(exc).startswith(RUN_FAILED):",
        "failure = text.removeprefix(RUN_FAILED)",
        "if reason == INTERRUPTED:",
        "if not evaluated and reason != INTERRUPTED:",
        'done = summary["finish_reason"] == "epochs"',
        'if reason.startswith("failed: "):',
        'if reason == "interrupted" or "silent" in reason:',
    ]
    assert _matches("\n".join(caught)) == caught
    kept = ['reason = FinishReason("epochs")', 'log.info("stopped: %s", why)', "x == epochs"]
    assert _matches("\n".join(kept)) == []


def test_no_code_matches_a_run_ending_by_its_text() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {line}"
        for floor in FLOORS
        for path in sorted((ROOT / floor).rglob("*.py"))
        for line in _matches(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_a_run_ended_carries_its_reason_and_failure() -> None:
    failed = RunEnded(FinishReason.FAILED, "shard 1 lost")
    assert (failed.reason, failed.failure) == (FinishReason.FAILED, "shard 1 lost")
    assert str(failed) == "the server stopped the run: shard 1 lost"
    assert str(RunEnded(FinishReason.EPOCHS)) == "training has ended"
    assert [r.value for r in FinishReason if r.completed] == ["epochs", "max_steps", "target_oa"]
