"""Evaluation during and after training, beside the updates.

Evaluations run on their own low-priority thread and always take the newest published
version: when training produces versions faster than they can be scored, the superseded ones
are skipped (and counted) instead of queueing up; the first time they fall behind is a
warning. ``--eval-samples N`` scores in-run evaluations on a fixed stratified subset of the
test split; without it they score the whole test split until they fall behind, then a subset
sized to fit between two requests (``auto_subset_size``). The final evaluation always uses
the whole test split. Eval events are logged when the score is known (so ``metrics.jsonl``
stays in time order) and carry when their version was made: ``version_t`` on the run clock,
``train_t`` on the training clock, and ``epochs_done`` (samples applied / training samples),
which places mid-epoch ones.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from common.data.splits import take_stratified
from common.training.evaluator import Evaluator, lower_thread_priority, record_evaluation
from common.training.metrics import Scores
from common.training.runlog import RunLog

log = logging.getLogger(__name__)

# The newest published state: (version, state, release-when-done).
Fetch = Callable[[], Awaitable[tuple[int, np.ndarray, Callable[[], None]]]]
KeepBest = Callable[[int, np.ndarray, float], Awaitable[None]]  # version, state, full-split OA
HISTORY = 4096
MIN_AUTO_SUBSET = 1000  # test samples an automatic subset keeps at least (OA +-1 % at 0.9)
AUTO_SHARE = 0.5  # of the time between two requests an automatic subset may take


def auto_subset_size(rate: float, interval_s: float, test_size: int) -> int:
    """The in-run subset an evaluation can score in ``AUTO_SHARE`` of the request interval.

    Args:
        rate: test samples scored per second (measured).
        interval_s: seconds between two evaluation requests.
        test_size: samples in the test split.

    Returns:
        A size in [min(MIN_AUTO_SUBSET, test_size), test_size].
    """
    fits = int(rate * interval_s * AUTO_SHARE)
    return max(min(MIN_AUTO_SUBSET, test_size), min(fits, test_size))


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    """When and where a version was made."""

    epoch: int
    samples: int
    version_t: float
    train_t: float


class EvalScheduler:
    """Scores the newest version on request, one evaluation at a time.

    Args:
        evaluator: scores a flat state.
        run_log: where eval events go.
        fetch: returns the newest published state.
        subset_size: in-run evaluations use this many test samples (None: all).
        seed: seed of the subset.
        on_record: called with each eval record (target checks, status).
        keep_best: offered every state scored on the whole test split, with its OA.
    """

    def __init__(
        self,
        evaluator: Evaluator,
        run_log: RunLog,
        *,
        fetch: Fetch,
        subset_size: int | None,
        seed: int,
        on_record: Callable[[dict[str, Any]], None],
        keep_best: KeepBest | None = None,
    ) -> None:
        self.evaluator, self.log, self.fetch, self.on_record = evaluator, run_log, fetch, on_record
        self.keep_best = keep_best
        self.seed, self.auto = seed, subset_size is None
        self.subset: np.ndarray | None = None
        if subset_size is not None:
            self._use_subset(subset_size)
        self.train_size = max(1, len(evaluator.reader.train_indices))
        self.versions: collections.OrderedDict[int, VersionInfo] = collections.OrderedDict()
        self.skipped = 0
        self._rate: float | None = None  # test samples scored per second, last evaluation
        self._requested_at: float | None = None
        self._skip_interval: float | None = None  # set when first behind, until the subset fits
        self._fell_behind = False
        self._wanted = False
        self._last: tuple[int, Scores, int] | None = None  # version, scores, samples (all)
        self._runner: asyncio.Task[None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="eval", initializer=lower_thread_priority
        )

    def made(self, version: int, info: VersionInfo) -> None:
        """Remember when ``version`` was made (called for every published version)."""
        self.versions[version] = info
        while len(self.versions) > HISTORY:
            self.versions.popitem(last=False)

    def _use_subset(self, size: int) -> None:
        """Score in-run evaluations on a fixed stratified subset of ``size`` test samples."""
        reader = self.evaluator.reader
        test = reader.test_indices
        if size < len(test):
            labels = reader.labels[test]
            picked = take_stratified(labels, size, np.random.default_rng(self.seed))
            self.subset = test[picked]

    def request(self) -> None:
        """Score the newest version soon; a request while one runs is merged into the next."""
        now = asyncio.get_running_loop().time()
        interval = None if self._requested_at is None else now - self._requested_at
        self._requested_at = now
        if self._runner is not None and not self._runner.done():
            if not self._fell_behind:
                self._fell_behind = True
                self._first_late(interval)
            if self._wanted:
                self.skipped += 1
            self._wanted = True
            return
        self._wanted = True
        self._runner = asyncio.create_task(self._run(), name="evaluations")

    async def _run(self) -> None:
        while self._wanted:
            self._wanted = False
            try:
                await self._evaluate(self.subset, final=False)
            except Exception:
                log.exception("evaluation failed")

    def _first_late(self, interval: float | None) -> None:
        """The first request that finds an evaluation still running (its version will not be
        scored: a newer one will): warn once; without --eval-samples, move in-run evaluations
        to a subset that fits (sized when the running evaluation has measured the rate)."""
        if self.auto and interval is not None:
            self._skip_interval = interval
            if self._rate is not None:
                self._fit_subset()
            return
        scored = len(self.evaluator.reader.test_indices if self.subset is None else self.subset)
        log.warning(
            "evaluations fell behind training: scoring %d test samples takes longer than "
            "training between two evaluations, so versions are skipped and the accuracy curve "
            "gets fewer points; a smaller "
            "--eval-samples N (a fixed stratified subset; the final evaluation scores all) or "
            "a larger --eval-every gives one per request",
            scored,
        )

    def _fit_subset(self) -> None:
        """Choose the automatic subset from the measured rate and the interval of the skip."""
        test_size = len(self.evaluator.reader.test_indices)
        assert self._rate is not None and self._skip_interval is not None
        self._use_subset(auto_subset_size(self._rate, self._skip_interval, test_size))
        self._skip_interval = None
        log.warning(
            "evaluations fell behind training: scoring %d test samples takes longer than "
            "training between two evaluations; in-run evaluations now score a fixed stratified "
            "subset of %d so each gets its point (--eval-samples N sets the size; the final "
            "evaluation scores all)",
            test_size,
            test_size if self.subset is None else len(self.subset),
        )

    async def final(self, version: int) -> dict[str, Any] | None:
        """Wait for a running evaluation, then record the final ``version`` scored on the
        whole test split (reusing the scores when the last in-run evaluation just did that)."""
        self._wanted = False
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
        if self._last is not None and self._last[0] == version:
            _, scores, scored = self._last
            return self._record(version, scores, scored, eval_s=0.0, final=True)
        return await self._evaluate(None, final=True)

    async def _evaluate(self, indices: np.ndarray | None, final: bool) -> dict[str, Any] | None:
        version, state, release = await self.fetch()
        loop = asyncio.get_running_loop()
        begin = loop.time()
        try:
            scores = await loop.run_in_executor(self._pool, self.evaluator.evaluate, state, indices)
            eval_s = loop.time() - begin
            if indices is None and self.keep_best is not None:
                await self.keep_best(version, state, scores.oa)
        finally:
            release()
        scored = len(self.evaluator.reader.test_indices if indices is None else indices)
        self._rate = scored / max(eval_s, 1e-6)
        if self._skip_interval is not None and not final:
            self._fit_subset()
        self._last = (version, scores, scored) if indices is None else None
        return self._record(version, scores, scored, eval_s=eval_s, final=final)

    def _record(
        self, version: int, scores: Scores, scored: int, eval_s: float, final: bool
    ) -> dict[str, Any]:
        """Log the evaluation of ``version`` and pass it on."""
        info = self.versions.get(version, VersionInfo(0, 0, self.log.now(), 0.0))
        record = record_evaluation(
            self.log,
            scores,
            version=version,
            epoch=info.epoch,
            samples=info.samples,
            eval_s=eval_s,
            version_t=round(info.version_t, 6),
            train_t=round(info.train_t, 6),
            epochs_done=round(info.samples / self.train_size, 3),
            test_samples=scored,
            subset=scored < len(self.evaluator.reader.test_indices),
            final=final,
        )
        self.on_record(record)
        return record

    async def close(self) -> None:
        """Cancel a running evaluation and stop the thread."""
        self._wanted = False
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
