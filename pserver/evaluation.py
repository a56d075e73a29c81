"""Evaluation during and after training, beside the updates.

Evaluations run on their own low-priority thread and always take the newest published
version: when training produces versions faster than they can be scored, the superseded ones
are skipped (and counted) instead of queueing up. ``--eval-samples N`` scores in-run
evaluations on a fixed stratified subset of the test split; the final evaluation always uses
the whole test split. Eval events are logged when the score is known (so ``metrics.jsonl`` stays
in time order) and carry when their version was made: ``version_t`` on the run clock and
``train_t`` on the training clock.
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
from common.training.runlog import RunLog

log = logging.getLogger(__name__)

# The newest published state: (version, state, release-when-done).
Fetch = Callable[[], Awaitable[tuple[int, np.ndarray, Callable[[], None]]]]
HISTORY = 4096


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
    """

    def __init__(
        self,
        evaluator: Evaluator,
        run_log: RunLog,
        fetch: Fetch,
        subset_size: int | None,
        seed: int,
        on_record: Callable[[dict[str, Any]], None],
    ) -> None:
        self.evaluator, self.log, self.fetch, self.on_record = evaluator, run_log, fetch, on_record
        reader = evaluator.reader
        test = reader.test_indices
        self.subset: np.ndarray | None = None
        if subset_size is not None and subset_size < len(test):
            labels = reader.labels[test]
            picked = take_stratified(labels, subset_size, np.random.default_rng(seed))
            self.subset = test[picked]
        self.versions: collections.OrderedDict[int, VersionInfo] = collections.OrderedDict()
        self.skipped = 0
        self._wanted = False
        self._last: dict[str, Any] | None = None
        self._runner: asyncio.Task[None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="eval", initializer=lower_thread_priority
        )

    def made(self, version: int, info: VersionInfo) -> None:
        """Remember when ``version`` was made (called for every published version)."""
        self.versions[version] = info
        while len(self.versions) > HISTORY:
            self.versions.popitem(last=False)

    def request(self) -> None:
        """Score the newest version soon; a request while one runs is merged into the next."""
        if self._runner is not None and not self._runner.done():
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

    async def final(self, version: int) -> dict[str, Any] | None:
        """Wait for a running evaluation, then score the final ``version`` on the whole test
        split (unless that evaluation just happened)."""
        self._wanted = False
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
        last = self._last
        if last is not None and last["version"] == version and self.subset is None:
            return last
        return await self._evaluate(None, final=True)

    async def _evaluate(self, indices: np.ndarray | None, final: bool) -> dict[str, Any] | None:
        version, state, release = await self.fetch()
        loop = asyncio.get_running_loop()
        begin = loop.time()
        try:
            scores = await loop.run_in_executor(self._pool, self.evaluator.evaluate, state, indices)
        finally:
            release()
        info = self.versions.get(version, VersionInfo(0, 0, self.log.now(), 0.0))
        record = record_evaluation(
            self.log,
            scores,
            version=version,
            epoch=info.epoch,
            samples=info.samples,
            eval_s=loop.time() - begin,
            version_t=round(info.version_t, 6),
            train_t=round(info.train_t, 6),
            test_samples=len(self.evaluator.reader.test_indices if indices is None else indices),
            final=final,
        )
        self._last = record
        self.on_record(record)
        return record

    async def close(self) -> None:
        """Cancel a running evaluation and stop the thread."""
        self._wanted = False
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
