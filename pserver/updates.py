"""Applying updates: one at a time, with the schedule's learning rate, a guard against absurd
gradients, and the two-phase publish (prepare, then publish or abort) on the parameter stores."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics

from common.errors import ErrorCode, ProtocolError
from common.training.schedule import lr_factor
from pserver.config import ServerConfig
from pserver.policies.base import Update
from pserver.store.service import StageReport
from pserver.store.stores import ParameterStores

log = logging.getLogger(__name__)

GUARD_WINDOW = 64
GUARD_WARMUP = 8
# Before enough norms are known, only pushes beyond these are refused (no sane model has them).
GRAD_NORM_CAP = 1e8
BUFFER_NORM_CAP = 1e8
# A task whose gradient was refused this many times, recomputed on fresh parameters each time,
# is taken clipped to the limit: its norm is what the samples give, and a sync round (whose
# parameters cannot change until it closes) would otherwise refuse it forever.
REFUSALS_BEFORE_CLIP = 3
REMEMBERED_REFUSALS = 1024


class GradientGuard:
    """Decides per push: refuse an absurd gradient, or (``--max-grad-norm``) clip it.

    By default nothing is clipped, so weighted-sync stays exact: a push is refused only when
    its gradient (or buffer change) norm exceeds ``outlier_factor`` times the median of the
    last accepted ones (or a fixed cap while fewer than 8 are known). A task whose gradient
    was refused ``REFUSALS_BEFORE_CLIP - 1`` times is then taken with its gradient clipped to
    the limit, so training cannot stall on it.

    Args:
        max_grad_norm: clip pushes to this gradient norm (None: never clip).
        outlier_factor: how far beyond the recent median a norm may go.
    """

    def __init__(self, max_grad_norm: float | None, outlier_factor: float) -> None:
        self.max_grad_norm, self.outlier_factor = max_grad_norm, outlier_factor
        self._grads: collections.deque[float] = collections.deque(maxlen=GUARD_WINDOW)
        self._buffers: collections.deque[float] = collections.deque(maxlen=GUARD_WINDOW)
        self.refused = 0
        self.clipped = 0
        self._refusals: collections.OrderedDict[int, int] = collections.OrderedDict()

    def _limit(self, recent: collections.deque[float], cap: float) -> float:
        if len(recent) < GUARD_WARMUP:
            return cap
        return self.outlier_factor * max(statistics.median(recent), 1e-6)

    def check(self, report: StageReport, task_id: int) -> float:
        """The factor to apply to this push of ``task_id`` (1.0 unless clipped).

        Raises:
            ProtocolError: NON_FINITE for NaN/Inf; REFUSED for an absurd norm.
        """
        if not report.finite:
            raise ProtocolError(ErrorCode.NON_FINITE, "pushed gradient contains NaN or Inf")
        grad = math.sqrt(report.grad_sq)
        buffers = math.sqrt(report.buffer_sq)
        factor = 1.0
        refusals = self._refusals.get(task_id, 0)
        for norm, recent, cap, what in (
            (grad, self._grads, GRAD_NORM_CAP, "gradient"),
            (buffers, self._buffers, BUFFER_NORM_CAP, "buffer change"),
        ):
            limit = self._limit(recent, cap)
            if norm <= limit:
                continue
            if what == "gradient" and refusals + 1 >= REFUSALS_BEFORE_CLIP and limit < cap:
                log.warning(
                    "gradient norm %.3g of task %d was refused %d times (limit %.3g); taking "
                    "it clipped to the limit",
                    norm,
                    task_id,
                    refusals,
                    limit,
                )
                factor = limit / norm
                continue
            self._refusals[task_id] = refusals + 1
            self._refusals.move_to_end(task_id)
            while len(self._refusals) > REMEMBERED_REFUSALS:
                self._refusals.popitem(last=False)
            self.refused += 1
            raise ProtocolError(
                ErrorCode.REFUSED,
                f"{what} norm {norm:.3g} is far beyond recent pushes (limit {limit:.3g})",
            )
        self._refusals.pop(task_id, None)
        self._grads.append(grad * factor)
        self._buffers.append(buffers)
        if self.max_grad_norm is not None and grad * factor > self.max_grad_norm:
            factor = self.max_grad_norm / grad
        if factor != 1.0:
            self.clipped += 1
        return factor


class Updater:
    """Applies updates in order and counts them.

    Hold ``lock`` around ``apply`` and whatever must see the state and the books agree
    (booking the update, capturing a checkpoint).

    Args:
        config: the server configuration (schedule, limits).
        stores: where the parameters live.
        train_count: size of the training split.
    """

    def __init__(self, config: ServerConfig, stores: ParameterStores, train_count: int) -> None:
        self.config, self.stores, self.train_count = config, stores, train_count
        self.lock = asyncio.Lock()
        self.version = 0
        self.steps = 0
        self.samples_applied = 0

    def progress(self) -> float:
        """Fraction of training done, for the learning-rate schedule."""
        if self.config.max_steps is not None:
            return self.steps / self.config.max_steps
        if self.config.epochs is not None:
            return self.samples_applied / (self.config.epochs * self.train_count)
        return 0.0

    def lr_factor(self) -> float:
        """The schedule's factor for the next update."""
        cfg = self.config
        return lr_factor(cfg.lr_schedule, self.progress(), cfg.warmup_fraction)

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
