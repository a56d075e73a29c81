"""A ``SliceStore`` served on an event loop: workers' gradient chunks and pulls, and the
coordinator's commands (staged? prepare, publish or abort, drop, capture).

With ``--shards 1`` the coordinator uses it directly as its parameter store.

Tensor work runs on one dedicated thread when the slice is large (so the loop keeps
serving) and inline when it is small (a thread hop costs more than the arithmetic); either
way one call runs at a time, in order.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from common.errors import ErrorCode, ProtocolError
from common.protocol.chunks import as_tensor, encode
from common.protocol.messages import (
    GradientChunk,
    GradientPushRequest,
    Message,
    ParamsChunk,
    PullRequest,
)
from common.protocol.tokens import TokenBook
from pserver.store.pool import Lease
from pserver.store.slices import SliceStore, StagedGradient

log = logging.getLogger(__name__)

INLINE_ELEMS = 1 << 18  # slices up to 1 MB of float32 are updated on the loop itself
CLOSED_TASKS = 1 << 16  # recently closed task ids whose late chunks are refused
_T = TypeVar("_T")


class Replier(Protocol):
    """How the service answers requests (the server's endpoint)."""

    def reply(
        self, identity: bytes, request_id: int, message: Message, lease: Lease | None = None
    ) -> None:
        """Send ``message`` as the reply; hold ``lease`` until the frames are on the wire."""

    def reply_error(self, identity: bytes, request_id: int, code: ErrorCode, text: str) -> None:
        """Send an error reply."""


@dataclasses.dataclass
class CapturedState:
    """The whole state (or a store's slice of it) at one version."""

    version: int
    optimizer_steps: int
    slots: list[str]
    state: np.ndarray
    slot_state: np.ndarray  # (len(slots), parameters)


@dataclasses.dataclass(frozen=True)
class StageReport:
    """A push's gradient as its store(s) received it."""

    finite: bool
    grad_sq: float
    buffer_sq: float


@dataclasses.dataclass
class _Encoded:
    version: int
    chunks: dict[int, tuple[np.ndarray, float]]
    lease: Lease | None  # the state buffer, when chunks are views of it (fp32)


class StoreService:
    """Serves one slice.

    Args:
        store: the slice.
        wire: the run's wire format.
        tokens: checks worker tokens.
        replier: sends replies.
        pull_timeout_s: how long a pull may wait for the version it asks for.
    """

    def __init__(
        self,
        store: SliceStore,
        wire: str,
        *,
        tokens: TokenBook,
        replier: Replier,
        pull_timeout_s: float,
    ) -> None:
        self.store, self.wire, self.tokens, self.replier = store, wire, tokens, replier
        self.pull_timeout_s = pull_timeout_s
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store")
            if store.size > INLINE_ELEMS
            else None
        )
        self._pending: dict[int, list[tuple[bytes, int, int]]] = collections.defaultdict(list)
        self._complete: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self._published = asyncio.Event()
        self._encoded: _Encoded | None = None
        self._whole: _Encoded | None = None  # one-chunk slices: the published one, held
        self._finished_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._closed = False

    @property
    def version(self) -> int:
        """The published version."""
        return self.store.version

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- from workers -----------------------------------------------------------------------

    @property
    def one_chunk(self) -> bool:
        """The slice is one chunk: pushes may carry their gradient (``gradient_push_request``)."""
        return len(self.store.spans) == 1

    @property
    def fused_params(self) -> Callable[[], tuple[ParamsChunk, Lease | None] | None] | None:
        """``whole_params`` when the slice is one chunk, else None."""
        return self.whole_params if self.one_chunk else None

    async def wait_ready(self) -> None:
        """The slice serves from the start."""

    async def on_gradient_chunk(self, identity: bytes, request_id: int, msg: GradientChunk) -> None:
        """Stage one chunk; its reply waits for the update the gradient goes into."""
        staged = await self._stage(
            msg.worker_id, msg.task_id, msg.token, msg.version, msg.offset, msg.scale, msg.gradient
        )
        self._pending[msg.task_id].append((identity, request_id, msg.offset))
        if staged.complete(self.store.size):
            self._complete[msg.task_id].set()

    async def on_gradient_push(self, msg: GradientPushRequest) -> None:
        """Stage the whole gradient that came inside its push; no chunk reply waits (the
        push's reply carries the parameters).

        Raises:
            ProtocolError: BAD_FIELD when the slice is more than one chunk; as a chunk is
                refused otherwise.
        """
        if not self.one_chunk:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"the state is {len(self.store.spans)} chunks: send them as gradient_chunk",
            )
        staged = await self._stage(
            msg.worker_id, msg.task_id, msg.push_token, msg.version, self.store.lo, msg.scale,
            msg.gradient,
        )  # fmt: skip
        if staged.complete(self.store.size):
            self._complete[msg.task_id].set()

    async def _stage(
        self,
        worker_id: int,
        task_id: int,
        push_token: str,
        version: int,
        offset: int,
        scale: float,
        gradient: np.ndarray,
    ) -> StagedGradient:
        self._check_open()
        self.tokens.check_push(worker_id, task_id, push_token)
        if task_id in self._finished_ids:
            raise ProtocolError(ErrorCode.WRONG_TASK, f"task {task_id} is already closed")
        data = as_tensor(gradient, self.wire, "gradient")
        return await self._run(self.store.stage, task_id, worker_id, version, offset, scale, data)

    async def on_pull(self, identity: bytes, request_id: int, msg: PullRequest) -> None:
        """Answer with one chunk of the published parameters, once ``min_version`` is out."""
        self._check_open()
        self.tokens.check(msg.worker_id, msg.token)
        if self.store._span_of.get(msg.offset) != msg.length:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"[{msg.offset}, +{msg.length}) is not a chunk of "
                f"[{self.store.lo}, {self.store.hi})",
            )
        if msg.min_version > self.store.version + 1:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"version {msg.min_version} is not the next to be published"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pull_timeout_s
        while self.store.version < msg.min_version:
            left = deadline - loop.time()
            if left <= 0 or self._closed:
                raise ProtocolError(
                    ErrorCode.SHUTTING_DOWN if self._closed else ErrorCode.INCOMPLETE,
                    f"version {msg.min_version} was not published in time",
                )
            published = self._published
            try:
                await asyncio.wait_for(published.wait(), left)
            except TimeoutError:
                continue
        await self._send_chunks([(identity, request_id, msg.offset)])

    # --- from the coordinator ---------------------------------------------------------------

    async def staged(self, task_id: int, worker_id: int, timeout_s: float) -> StageReport:
        """Wait until every chunk of ``task_id``'s gradient is in.

        Raises:
            ProtocolError: INCOMPLETE after ``timeout_s``; WRONG_TASK if another worker staged it.
        """
        event = self._complete[task_id]
        try:
            if not event.is_set():  # (a gradient that came inside its push is in already)
                await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            raise ProtocolError(
                ErrorCode.INCOMPLETE,
                f"the gradient of task {task_id} did not fully arrive within {timeout_s:g} s",
            ) from None
        staged = self.store.staged.get(task_id)
        if staged is None:
            raise ProtocolError(ErrorCode.WRONG_TASK, f"the push of task {task_id} was withdrawn")
        if staged.worker_id != worker_id:
            raise ProtocolError(
                ErrorCode.WRONG_TASK, f"task {task_id} was pushed by another worker"
            )
        return StageReport(staged.finite, staged.grad_sq, staged.buffer_sq)

    async def prepare(
        self,
        version: int,
        task_ids: list[int],
        weights: list[float],
        lr_scale: float,
        buffer_scale: float,
    ) -> tuple[bool, str]:
        """Compute the candidate of ``version`` (see ``SliceStore.prepare``)."""
        return await self._run(
            self.store.prepare, version, task_ids, weights, lr_scale, buffer_scale
        )

    async def publish(self, version: int) -> None:
        """Publish the candidate and answer its tasks' chunks with the new parameters."""
        task_ids = await self._run(self.store.publish, version)
        self._encoded = None
        published, self._published = self._published, asyncio.Event()
        published.set()
        waiting = [entry for t in task_ids for entry in self._pending.pop(t, [])]
        self._wake(task_ids)
        self._close_tasks(task_ids)  # applied: a replay of its chunks is refused
        if self.one_chunk:
            whole, self._whole = self._whole, await self._run(self._encode)
            if whole is not None and whole.lease is not None:
                whole.lease.release()
        await self._send_chunks(waiting)

    def whole_params(self) -> tuple[ParamsChunk, Lease | None] | None:
        """The published parameters as one chunk and the lease that keeps its buffer, for the
        reply to a push that carried its gradient; None when the slice is more than one chunk
        or nothing new was published yet."""
        whole = self._whole
        if whole is None or whole.version != self.store.version:
            return None
        data, scale = whole.chunks[self.store.lo]
        return ParamsChunk(version=whole.version, offset=self.store.lo, scale=scale, params=data), (
            whole.lease
        )

    async def abort(self, version: int, code: int, message: str) -> None:
        """Discard the candidate and answer its tasks' chunks with error ``code``. The tasks are
        closed: their samples are handed out again under new tasks."""
        task_ids = await self._run(self.store.abort)
        self._close_tasks(task_ids)
        await self.drop(task_ids, code, message)

    async def drop(self, task_ids: list[int], code: int, message: str) -> None:
        """Forget staged gradients and answer their chunks with error ``code`` (the task may be
        pushed again: after STALE, NON_FINITE or INCOMPLETE the worker recomputes it, and a
        chunk of the dropped push that comes only now is answered with ``code`` too; after
        UNKNOWN_WORKER, the task of a worker that left, it never is, and later chunks of it
        are refused)."""
        error = error_code(code)
        refusal = None
        if error == ErrorCode.UNKNOWN_WORKER:  # first: a chunk that comes meanwhile is refused
            self._close_tasks(task_ids)
        else:
            refusal = ProtocolError(error, message)
        await self._run(self.store.drop, task_ids, refusal)
        self._wake(task_ids)
        for task_id in task_ids:
            for identity, request_id, _ in self._pending.pop(task_id, []):
                self.replier.reply_error(identity, request_id, error, message)

    def _close_tasks(self, task_ids: list[int]) -> None:
        """Refuse every later chunk of these tasks (the newest ``CLOSED_TASKS`` are kept)."""
        for task_id in task_ids:
            self._finished_ids[task_id] = None
        while len(self._finished_ids) > CLOSED_TASKS:
            self._finished_ids.popitem(last=False)

    def _wake(self, task_ids: list[int]) -> None:
        """Wake whoever waits for these tasks' gradients (they were applied or withdrawn)."""
        for task_id in task_ids:
            event = self._complete.pop(task_id, None)
            if event is not None:
                event.set()

    async def capture(self, with_slots: bool) -> CapturedState:
        """The published slice (a copy) and, if asked, the optimizer slots."""

        def work() -> CapturedState:
            state = self.store.state.numpy().copy()
            names, rows = self.store.slot_state() if with_slots else ([], torch.zeros(0))
            steps = self.store.optimizer.steps
            return CapturedState(self.store.version, steps, names, state, rows.numpy())

        return await self._run(work)

    async def newest_state(self) -> tuple[int, np.ndarray, Callable[[], None]]:
        """The published version and its state without a copy, and the call that lets go of
        it (the buffer is not reused before)."""
        store = self.store
        return store.version, store.state.numpy(), store.lease.hold().release

    @property
    def addresses(self) -> list[str]:
        """Where workers reach this store: the coordinator itself ("")."""
        return [""]

    @property
    def bounds(self) -> list[int]:
        """The slice's range boundaries."""
        return [self.store.lo, self.store.hi]

    async def close(self, reason: str) -> None:
        """Answer everything pending with SHUTTING_DOWN and refuse new work."""
        self.stop(reason)

    def stop(self, reason: str) -> None:
        """Answer everything pending with SHUTTING_DOWN and refuse new work."""
        self._closed = True
        self._published.set()
        for task_id in list(self._pending):
            for identity, request_id, _ in self._pending.pop(task_id):
                self.replier.reply_error(identity, request_id, ErrorCode.SHUTTING_DOWN, reason)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "training has ended")

    # --- replies ----------------------------------------------------------------------------

    async def _send_chunks(self, waiting: list[tuple[bytes, int, int]]) -> None:
        if not waiting:
            return
        encoded = self._encoded
        fresh = encoded is None or encoded.version != self.store.version
        if fresh:
            encoded = self._encoded = await self._run(self._encode)
        assert encoded is not None
        try:
            for identity, request_id, offset in waiting:
                data, scale = encoded.chunks[offset]
                self.replier.reply(
                    identity,
                    request_id,
                    ParamsChunk(version=encoded.version, offset=offset, scale=scale, params=data),
                    lease=encoded.lease,
                )
        finally:
            if fresh and encoded.lease is not None:
                encoded.lease.release()  # the hold _encode took; each reply holds its own

    def _encode(self) -> _Encoded:
        """Wire chunks of the published slice. With fp32 they are views of the state buffer:
        a hold is taken here, on the thread that also prepares updates, so the buffer cannot be
        recycled before the replies that send it hold it themselves."""
        store = self.store
        lease = store.lease.hold() if self.wire == "fp32" else None
        chunks = {
            start: encode(store.state[start - store.lo : stop - store.lo], self.wire)
            for start, stop in store.spans
        }
        return _Encoded(store.version, chunks, lease)


def error_code(code: int) -> ErrorCode:
    """``code`` as an ``ErrorCode``; INTERNAL when it is none."""
    return ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
