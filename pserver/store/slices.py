"""One contiguous slice of the flat state: its parameters, its optimizer state, the gradient
chunks pushed for it, and updates computed as candidates that are published or discarded.

The same class serves the single server (one slice over the whole state) and every shard
(its own range), so a sharded update runs exactly the unsharded arithmetic, element by
element. Gradients are summed in the order the coordinator gives (worker id), never in
arrival order, so the result does not depend on network timing.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from common.errors import ErrorCode, ProtocolError
from common.protocol.chunks import check_scale, chunk_spans
from pserver.store.optimizer import UNSEEN, FlatOptimizer
from pserver.store.pool import BufferPool, Lease

MAX_STAGED_PER_WORKER = 2  # its task of a round and one taken over from a worker that left
LATE_PUSHES = 1 << 12  # dropped pushes whose missing chunks are still refused when they come


@dataclasses.dataclass
class StagedGradient:
    """The chunks of one task's gradient received so far, with running checks."""

    task_id: int
    worker_id: int
    version: int
    parts: dict[int, tuple[torch.Tensor, float]] = dataclasses.field(default_factory=dict)
    received: int = 0
    grad_sq: float = 0.0
    buffer_sq: float = 0.0
    finite: bool = True

    def complete(self, size: int) -> bool:
        """Every element of the slice has arrived."""
        return self.received == size


@dataclasses.dataclass
class LateChunks:
    """The chunks a push had not delivered when it was dropped, and how they are refused."""

    version: int | None  # None: the push delivered nothing, its chunks are of any version
    offsets: set[int]
    refusal: ProtocolError
    answered: set[int] = dataclasses.field(default_factory=set)  # came, and were refused


@dataclasses.dataclass
class Candidate:
    """A computed, not yet published update."""

    version: int
    state: torch.Tensor
    lease: Lease
    slots: dict[str, torch.Tensor]
    task_ids: list[int]


class SliceStore:
    """The state elements ``[lo, hi)`` of a run and their optimizer state.

    Not thread-safe: the owner runs one call at a time (see ``StoreService``).

    Args:
        lo, hi: the slice of the flat state.
        num_params: parameters in the whole flat state (the rest are float buffers).
        state: the initial slice, ``hi - lo`` float32 values.
        optimizer: the optimizer for the slice's parameter part.
        nonneg_bounds: flat pairs ``[a0, b0, a1, b1, ...]`` of absolute ranges that must stay
            >= 0 (BatchNorm running variances).
        chunk_elems: elements per wire chunk.
        version: the version of ``state``.
    """

    def __init__(
        self,
        lo: int,
        hi: int,
        *,
        num_params: int,
        state: torch.Tensor,
        optimizer: FlatOptimizer,
        nonneg_bounds: list[int],
        chunk_elems: int,
        version: int = 0,
    ) -> None:
        if state.numel() != hi - lo:
            raise ValueError(f"slice [{lo}, {hi}) needs {hi - lo} values, got {state.numel()}")
        self.lo, self.hi = lo, hi
        self.size = hi - lo
        self.split = min(max(num_params - lo, 0), self.size)  # local start of the buffers
        self.optimizer = optimizer
        self.nonneg = [
            (max(a, lo) - lo, min(b, hi) - lo)
            for a, b in zip(nonneg_bounds[::2], nonneg_bounds[1::2], strict=True)
            if a < hi and b > lo
        ]
        spots = [i for a, b in self.nonneg for i in range(a, b)]
        self._nonneg = torch.tensor(spots, dtype=torch.long) if spots else None
        self.spans = chunk_spans(lo, hi, chunk_elems)
        self._span_of = {start: stop - start for start, stop in self.spans}
        self.pool = BufferPool(self.size)
        self.version = version
        self.state, self.lease = self.pool.adopt(state.contiguous())
        self.staged: dict[int, StagedGradient] = {}
        self.late: collections.OrderedDict[int, LateChunks] = collections.OrderedDict()
        self.candidate: Candidate | None = None
        self.discarded: list[int] = []  # the tasks of a candidate found invalid, until abort
        self._total = torch.empty(self.size)

    # --- staging ----------------------------------------------------------------------------

    def stage(
        self,
        task_id: int,
        worker_id: int,
        version: int,
        offset: int,
        scale: float,
        data: torch.Tensor,
    ) -> StagedGradient:
        """Keep one received chunk (``data`` in its wire dtype, times ``scale``).

        Returns:
            The task's staged gradient so far.

        Raises:
            ProtocolError: BAD_FIELD/BAD_TENSOR for a chunk that is not one of this slice's
                chunks, a duplicate, a scale its wire format does not send (``check_scale``), or
                a worker with too many staged tasks; the refusal of its push for a chunk that
                comes after the push was dropped without it (see ``drop``); nothing is kept
                then.
        """
        length = self._span_of.get(offset)
        if length is None or data.numel() != length:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"chunk at offset {offset} with {data.numel()} values is not a chunk of "
                f"[{self.lo}, {self.hi})",
            )
        late = self.late.get(task_id)
        if late is not None and late.version in (None, version) and offset in late.offsets:
            late.offsets.discard(offset)
            late.answered.add(offset)
            raise late.refusal
        check_scale(scale, data.dtype)
        staged = self.staged.get(task_id)
        if staged is None:
            mine = sum(1 for s in self.staged.values() if s.worker_id == worker_id)
            if mine >= MAX_STAGED_PER_WORKER:
                raise ProtocolError(
                    ErrorCode.BAD_FIELD, f"worker {worker_id} already has {mine} staged pushes"
                )
            staged = StagedGradient(task_id, worker_id, version)
        elif staged.worker_id != worker_id or staged.version != version:
            raise ProtocolError(ErrorCode.WRONG_TASK, f"task {task_id} is staged by another push")
        if offset in staged.parts:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"chunk at offset {offset} sent twice")
        local = offset - self.lo
        cut = min(max(self.split - local, 0), length)
        grad_sq, grad_finite = _square_sum(data[:cut])
        buffer_sq, buffer_finite = _square_sum(data[cut:])
        self.staged[task_id] = staged
        staged.parts[offset] = (data, scale)
        staged.received += length
        staged.grad_sq += grad_sq / scale**2
        staged.buffer_sq += buffer_sq / scale**2
        staged.finite = staged.finite and grad_finite and buffer_finite
        return staged

    def drop(self, task_ids: list[int], refusal: ProtocolError | None = None) -> None:
        """Forget staged gradients (rejected pushes, departed workers).

        Args:
            task_ids: the tasks whose gradients go.
            refusal: why their pushes were refused, when the tasks may be pushed again: a
                chunk a push had not delivered yet is refused with it when it comes (it is on
                its way: a worker sends every chunk before its push), so the next push of the
                task starts from nothing. Every chunk of a push found INCOMPLETE with none of
                them here is awaited so.
        """
        for task_id in task_ids:
            staged = self.staged.pop(task_id, None)
            earlier = self.late.get(task_id)
            if refusal is None or staged is not None:  # closed, or a newer push came in full
                self.late.pop(task_id, None)
            late = None if refusal is None else self._late_chunks(staged, refusal)
            if late is None:
                continue
            if earlier is not None:  # a chunk refused as late came: it is on its way no more
                late.offsets -= earlier.answered  # (if it was lost, the retry had it refused)
            if late.offsets:
                self.late[task_id] = late
                while len(self.late) > LATE_PUSHES:
                    self.late.popitem(last=False)
            else:
                self.late.pop(task_id, None)

    def _late_chunks(
        self, staged: StagedGradient | None, refusal: ProtocolError
    ) -> LateChunks | None:
        """The chunks still on their way of a push dropped with ``refusal`` (None: none)."""
        if staged is not None and not staged.complete(self.size):
            return LateChunks(staged.version, self._span_of.keys() - staged.parts.keys(), refusal)
        if staged is None and refusal.code == ErrorCode.INCOMPLETE:
            return LateChunks(None, set(self._span_of), refusal)
        return None

    # --- updates ----------------------------------------------------------------------------

    def prepare(
        self,
        version: int,
        task_ids: list[int],
        weights: list[float],
        lr_scale: float,
        buffer_scale: float,
    ) -> tuple[bool, str]:
        """Compute version ``version`` as a candidate: sum the staged gradients of ``task_ids``
        in that order with ``weights``, then the optimizer step (parameters) and
        ``old + buffer_scale * change`` (buffers).

        Returns:
            ``(ok, reason)``: whether the candidate is valid (finite parameters and optimizer
            state, variances not negative). An invalid candidate is discarded at once.

        Raises:
            ProtocolError: a task is not fully staged, or the version is not the next one.
        """
        if version != self.version + 1:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"version {version} does not follow {self.version}"
            )
        gradients = []
        for task_id in task_ids:
            staged = self.staged.get(task_id)
            if staged is None or not staged.complete(self.size):
                raise ProtocolError(ErrorCode.BAD_FIELD, f"task {task_id} is not fully staged")
            gradients.append(staged)
        self.abort()
        new, lease = self.pool.acquire()
        p, slots = self.split, self.optimizer.state
        for start, stop in self.spans:
            a, b = start - self.lo, stop - self.lo
            grad = self._sum(gradients, weights, start, self._total[a:b])
            if a < p:  # the parameter part of this chunk
                cut = min(b, p)
                slots = self.optimizer.prepare(
                    self.state[:p], grad[: cut - a], new[:p], lr_scale, window=(a, cut)
                )
            if b > p:  # the buffer part
                cut = max(a, p)
                torch.add(self.state[cut:b], grad[cut - a :], alpha=buffer_scale, out=new[cut:b])
        reason = self._invalid(new, slots)
        if reason:
            lease.release()
            self.discarded = list(task_ids)
            return False, reason
        self.candidate = Candidate(version, new, lease, slots, list(task_ids))
        return True, ""

    @staticmethod
    def _sum(
        gradients: list[StagedGradient], weights: list[float], start: int, window: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of the gradients' chunks at ``start``, in the given order (written
        into ``window``, except for a single float32 chunk with weight 1: used as it is)."""
        if not gradients:
            return window.zero_()
        first, scale = gradients[0].parts[start]
        alpha = weights[0] / scale
        if len(gradients) == 1 and alpha == 1.0 and first.dtype == torch.float32:
            return first
        window.copy_(first)
        if alpha != 1.0:
            window.mul_(alpha)
        for staged, weight in zip(gradients[1:], weights[1:], strict=True):
            data, scale = staged.parts[start]
            window.add_(data, alpha=weight / scale)
        return window

    def _invalid(self, new: torch.Tensor, slots: dict[str, torch.Tensor]) -> str:
        """Why a candidate is invalid ("" when it is not): one reduction each over the new
        state, the slots whose non-finite values it need not show, the variances; one read."""
        unseen = UNSEEN.get(self.optimizer.kind, ())
        checks = [new.sum(), *(slots[name].sum() for name in unseen)]
        if self._nonneg is not None:
            checks.append(new.index_select(0, self._nonneg).min())
        found = torch.stack(checks).tolist()
        if not math.isfinite(found[0]):
            return "the update makes parameters or statistics non-finite"
        if not all(map(math.isfinite, found[1 : 1 + len(unseen)])):
            return "the update makes the optimizer state non-finite"
        if self._nonneg is not None and found[-1] < 0:
            return "the update makes a running variance negative"
        return ""

    def publish(self, version: int) -> list[int]:
        """Publish the candidate of ``version``.

        Returns:
            The task ids it was computed from (their staged gradients are dropped).

        Raises:
            ProtocolError: no candidate of that version.
        """
        candidate = self.candidate
        if candidate is None or candidate.version != version:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"no prepared update of version {version}")
        self.optimizer.publish(candidate.slots)
        self.lease.release()
        self.state, self.lease, self.version = candidate.state, candidate.lease, version
        self.candidate = None
        self.drop(candidate.task_ids)
        return candidate.task_ids

    def abort(self) -> list[int]:
        """Discard the candidate, if any; returns the task ids it was computed from (also
        when it was found invalid, and so discarded already)."""
        candidate, self.candidate = self.candidate, None
        discarded, self.discarded = self.discarded, []
        if candidate is None:
            return discarded
        candidate.lease.release()
        return candidate.task_ids

    # --- state ------------------------------------------------------------------------------

    def slot_state(self) -> tuple[list[str], torch.Tensor]:
        """The optimizer slots over the parameter part, one row per slot (a copy)."""
        names = list(self.optimizer.slots)
        p = self.split
        if not names:
            return names, torch.zeros(0, p)
        rows = [self.optimizer.state.get(n, torch.zeros(p)) for n in names]
        return names, torch.stack([r.reshape(-1) for r in rows])

    def load_slots(self, names: list[str], rows: torch.Tensor, steps: int) -> None:
        """Restore optimizer slots saved by ``slot_state``.

        Raises:
            ValueError: other slot names or sizes than this optimizer's.
        """
        if list(names) != list(self.optimizer.slots) or tuple(rows.shape) != (
            len(names),
            self.split,
        ):
            raise ValueError(
                f"optimizer state {names} {tuple(rows.shape)} does not fit "
                f"{list(self.optimizer.slots)} x {self.split}"
            )
        self.optimizer.state = {n: rows[i].clone() for i, n in enumerate(names)}
        self.optimizer.steps = steps


def _square_sum(values: torch.Tensor) -> tuple[float, bool]:
    """The sum of squares and whether every value is finite, in one fast pass.

    The float32 sum overflows for absurd but finite values (beyond ~1e19): it is then
    infinite, which the guard refuses as NON_FINITE; only then are the values checked one
    by one.
    """
    if values.numel() == 0:
        return 0.0, True
    flat = values if values.dtype == torch.float32 else values.float()
    square_sum = float(torch.dot(flat, flat))
    if math.isfinite(square_sum):
        return square_sum, True
    return math.inf, bool(torch.isfinite(flat).all())
