"""Applying updates: one at a time, with the schedule's learning rate, a guard against absurd
gradients, and the two-phase publish (prepare, then publish or abort) on the parameter stores."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics

from common.errors import ErrorCode, ProtocolError
from common.training.schedule import lr_factor, progress
from pserver.config import ServerConfig
from pserver.errorlog import RateLimitedLog
from pserver.policies.base import Update
from pserver.store.service import StageReport
from pserver.store.stores import ParameterStores

log = logging.getLogger(__name__)

GUARD_WINDOW = 16  # accepted norms remembered per member
GUARD_WARMUP = 8  # accepted pushes (all members) before the limit follows the typical norm
# Before enough norms are known, only pushes beyond these are refused (no sane model has them).
NORM_CAP = 1e8
# The typical norm never counts as smaller than this, so pushes of zeros cannot shrink the
# limit (``--outlier-factor`` times the typical norm) to nothing.
NORM_FLOOR = 0.1
# A task whose gradient was refused this many times, recomputed on fresh parameters each time,
# is taken clipped to the typical norm: a sync round (whose parameters cannot change until it
# closes) would otherwise refuse it forever.
REFUSALS_BEFORE_CLIP = 3
REMEMBERED_REFUSALS = 1024
# A member whose pushes were refused this many times in a row (none taken unclipped) is dropped.
STRIKES_BEFORE_DROP = 10


class _Norms:
    """The accepted norms of one kind (gradient or buffer change), per member."""

    def __init__(self) -> None:
        self.recent: dict[int, collections.deque[float]] = {}

    def typical(self) -> float | None:
        """The lower median over members of each member's median (so no single member moves
        it up, and one of two cannot), at least ``NORM_FLOOR``; None while warming up."""
        if sum(len(d) for d in self.recent.values()) < GUARD_WARMUP:
            return None
        medians = [statistics.median(d) for d in self.recent.values() if d]
        return max(statistics.median_low(medians), NORM_FLOOR)

    def add(self, worker_id: int, norm: float) -> None:
        self.recent.setdefault(worker_id, collections.deque(maxlen=GUARD_WINDOW)).append(norm)


class GradientGuard:
    """Decides per push: refuse an absurd gradient, or (``--max-grad-norm``) clip it.

    The norms judged are those of the values the stores will apply (the wire scale is checked
    before a chunk is staged). By default nothing is clipped, so weighted-sync stays exact: a
    push is refused when its gradient or buffer-change norm is not finite (NON_FINITE, also
    when its float32 sum of squares overflows) or exceeds ``outlier_factor`` times the typical
    norm (REFUSED). A task refused ``REFUSALS_BEFORE_CLIP - 1`` times is then taken clipped to
    the typical norm, so training cannot stall on it; a member refused
    ``STRIKES_BEFORE_DROP`` times in a row is dropped.

    Args:
        max_grad_norm: clip pushes to this gradient norm (None: never clip).
        outlier_factor: how far beyond the typical norm a norm may go.
    """

    def __init__(self, max_grad_norm: float | None, outlier_factor: float) -> None:
        self.max_grad_norm, self.outlier_factor = max_grad_norm, outlier_factor
        self._grads, self._buffers = _Norms(), _Norms()
        self.refused = 0
        self.clipped = 0
        self._refusals: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._strikes: dict[int, int] = {}
        self._warnings = RateLimitedLog(log)

    def forget(self, worker_id: int) -> None:
        """A member left: its norms no longer count."""
        for norms in (self._grads, self._buffers):
            norms.recent.pop(worker_id, None)
        self._strikes.pop(worker_id, None)

    def struck_out(self, worker_id: int) -> bool:
        """The member's pushes were refused too often in a row: it should be dropped."""
        return self._strikes.get(worker_id, 0) >= STRIKES_BEFORE_DROP

    def check(self, report: StageReport, task_id: int, worker_id: int) -> float:
        """The factor to apply to this push of ``task_id`` (1.0 unless clipped).

        Raises:
            ProtocolError: NON_FINITE for NaN/Inf (or an overflowing norm); REFUSED for an
                absurd norm.
        """
        grad, buffers = math.sqrt(report.grad_sq), math.sqrt(report.buffer_sq)
        if not (report.finite and math.isfinite(grad) and math.isfinite(buffers)):
            self._strike(worker_id)
            raise ProtocolError(ErrorCode.NON_FINITE, "pushed gradient contains NaN or Inf")
        refusals = self._refusals.get(task_id, 0)
        factor = 1.0
        kinds = ((grad, self._grads, "gradient"), (buffers, self._buffers, "buffer change"))
        for norm, norms, what in kinds:
            typical = norms.typical()
            if norm <= (NORM_CAP if typical is None else self.outlier_factor * typical):
                continue
            if typical is not None and refusals + 1 >= REFUSALS_BEFORE_CLIP:
                self._warnings.warning(
                    "clipped",
                    "task %d (worker %d) was refused %d times; taking it clipped to the "
                    "typical %s norm",
                    task_id,
                    worker_id,
                    refusals,
                    what,
                )
                factor = min(factor, typical / norm)
                continue
            self._refusals[task_id] = refusals + 1
            self._refusals.move_to_end(task_id)
            while len(self._refusals) > REMEMBERED_REFUSALS:
                self._refusals.popitem(last=False)
            self.refused += 1
            self._strike(worker_id)
            raise ProtocolError(
                ErrorCode.REFUSED, f"{what} norm {norm:.3g} is far beyond recent pushes"
            )
        self._refusals.pop(task_id, None)
        self._grads.add(worker_id, grad * factor)
        self._buffers.add(worker_id, buffers * factor)
        if factor == 1.0:
            self._strikes.pop(worker_id, None)
        if self.max_grad_norm is not None and grad * factor > self.max_grad_norm:
            factor = self.max_grad_norm / grad
        if factor != 1.0:
            self.clipped += 1
        return factor

    def _strike(self, worker_id: int) -> None:
        self._strikes[worker_id] = self._strikes.get(worker_id, 0) + 1


class Updater:
    """Applies updates in order and counts them.

    Hold ``lock`` around ``apply`` and whatever must see the state and the books agree
    (booking the update, capturing a checkpoint).

    Args:
        config: the server configuration (schedule, limits).
        stores: where the parameters live.
        train_count: size of the training split.
    """

    def __init__(self, config: ServerConfig, stores: ParameterStores, *, train_count: int) -> None:
        self.config, self.stores, self.train_count = config, stores, train_count
        self.lock = asyncio.Lock()
        self.version = 0
        self.steps = 0
        self.samples_applied = 0

    def lr_factor(self) -> float:
        """The schedule's factor for the next update."""
        cfg = self.config
        done = progress(
            self.steps, self.samples_applied, self.train_count, cfg.max_steps, cfg.epochs
        )
        return lr_factor(cfg.lr_schedule, done, cfg.warmup_fraction)

    async def apply(self, update: Update) -> str | None:
        """Apply ``update`` (call with ``lock`` held): every store prepares the new version,
        then all publish it, or all abort it if any store found it invalid.

        Returns:
            None when it was published; else why the stores refused it (they answered the
            pushes' chunks with REFUSED, and nothing was published).

        Raises:
            ShardLost: a shard did not answer.
        """
        version = self.version + 1
        lr_scale = update.lr_scale * self.lr_factor()
        ok, reason = await self.stores.prepare(
            version, update.task_ids, update.clipped_weights, lr_scale, update.buffer_scale
        )
        if not ok:
            message = f"update refused: {reason}; the samples will be handed out again"
            await self.stores.abort(version, ErrorCode.REFUSED, message)
            return message
        await self.stores.publish(version)
        self.version = version
        self.steps += 1
        self.samples_applied += update.samples
        return None

    def restore(self, version: int, steps: int, samples_applied: int) -> None:
        """Continue counting from a checkpoint."""
        self.version, self.steps, self.samples_applied = version, steps, samples_applied
