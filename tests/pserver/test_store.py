"""Parameter-store parts: buffer leases, staging rules, two-phase publish, the gradient guard."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from common.errors import ErrorCode, ProtocolError
from common.protocol.messages import GradientChunk
from common.protocol.tokens import TokenBook, new_key
from pserver.store.optimizer import FlatOptimizer
from pserver.store.pool import BufferPool
from pserver.store.service import StageReport, StoreService
from pserver.store.slices import SliceStore
from pserver.updates import (
    GUARD_WARMUP,
    NORM_FLOOR,
    REFUSALS_BEFORE_CLIP,
    STRIKES_BEFORE_DROP,
    GradientGuard,
)


@dataclasses.dataclass
class FakeTracker:
    """Stands in for zmq.MessageTracker: ``done`` once the frames left ZeroMQ."""

    done: bool = False


def test_a_buffer_is_reused_only_when_every_holder_let_go() -> None:
    pool = BufferPool(8, keep=2)
    first, lease = pool.acquire()
    sent = FakeTracker()
    lease.hold()  # a reply takes a hold while its send is queued...
    lease.track(sent)  # ...and hands over its tracker
    lease.release()
    lease.release()  # the owner lets go too
    second, _ = pool.acquire()
    assert second.data_ptr() != first.data_ptr()  # ZeroMQ still reads the first one
    sent.done = True
    third, _ = pool.acquire()
    assert third.data_ptr() == first.data_ptr()  # now it is free again
    with pytest.raises(RuntimeError):
        _, spare = pool.acquire()
        spare.release()
        spare.release()


def _store(size: int = 4096, num_params: int = 3072) -> SliceStore:
    state = torch.zeros(size)
    state[num_params:] = 1.0  # buffers; [3072, 4096) are running variances
    optimizer = FlatOptimizer("sgd", lr=0.5, momentum=0.9)
    return SliceStore(
        0,
        size,
        num_params=num_params,
        state=state,
        optimizer=optimizer,
        nonneg_bounds=[num_params, size],
        chunk_elems=1024,
    )


def test_staging_refuses_what_is_not_a_chunk_of_the_slice() -> None:
    store = _store()
    chunk = torch.ones(1024)
    store.stage(1, 7, 0, 0, 1.0, chunk)
    for args, code in (
        ((1, 7, 0, 0, 1.0, chunk), ErrorCode.BAD_FIELD),  # the same chunk twice
        ((1, 8, 0, 1024, 1.0, chunk), ErrorCode.WRONG_TASK),  # another worker's task
        ((2, 7, 0, 5, 1.0, chunk), ErrorCode.BAD_TENSOR),  # not a chunk boundary
        ((2, 7, 0, 0, 1.0, chunk[:10]), ErrorCode.BAD_TENSOR),  # wrong length
        ((2, 7, 0, 0, 3.0, chunk), ErrorCode.BAD_FIELD),  # scale not a power of two
    ):
        with pytest.raises(ProtocolError) as refused:
            store.stage(*args)
        assert refused.value.code == code
    store.stage(2, 7, 0, 0, 1.0, chunk)
    with pytest.raises(ProtocolError):  # a third staged push of the same worker
        store.stage(3, 7, 0, 0, 1.0, chunk)


def test_an_invalid_update_is_discarded_and_changes_nothing() -> None:
    store = _store()
    before = store.state.clone()
    bad = torch.zeros(4096)
    bad[3072:] = -10.0  # the running variances would become negative
    for offset in range(0, 4096, 1024):
        store.stage(1, 7, 0, offset, 1.0, bad[offset : offset + 1024])
    ok, reason = store.prepare(1, [1], [1.0], 1.0, 1.0)
    assert not ok and "variance" in reason
    assert store.candidate is None and store.version == 0
    assert torch.equal(store.state, before)
    assert all(bool((t == 0).all()) for t in store.optimizer.state.values())  # momentum too
    with pytest.raises(ProtocolError):
        store.publish(1)


@pytest.mark.parametrize("lr_scale", [1.0, 0.0])
@pytest.mark.parametrize(("kind", "why"), [("sgd", "parameters"), ("adam", "optimizer state")])
def test_a_candidate_whose_optimizer_state_overflows_is_discarded(
    kind: str, why: str, lr_scale: float
) -> None:
    """SGD's momentum always reaches the parameters, so their check covers it, also at a
    learning rate of 0 (a schedule's end: 0 times infinity is NaN); Adam's second moment
    divides the step (an infinite one leaves the parameters finite): checked apart."""
    momentum = 0.9 if kind == "sgd" else 0.0
    optimizer = FlatOptimizer(kind, lr=0.5, momentum=momentum, weight_decay=1e-4)
    store = SliceStore(
        0, 1024, num_params=1024, state=torch.zeros(1024), optimizer=optimizer,
        nonneg_bounds=[], chunk_elems=1024,
    )  # fmt: skip
    grad = torch.zeros(1024)
    grad[5] = 3e38  # finite; its square is not
    if kind == "sgd":  # a first step leaves a momentum of 3e38; the second overflows it
        store.stage(1, 7, 0, 0, 1.0, grad)
        assert store.prepare(1, [1], [1.0], lr_scale, 1.0) == (True, "")
        store.publish(1)
    before = (store.state.clone(), {k: v.clone() for k, v in optimizer.state.items()})
    store.stage(2, 7, store.version, 0, 1.0, grad)
    ok, reason = store.prepare(store.version + 1, [2], [1.0], lr_scale, 1.0)
    assert not ok and why in reason and "non-finite" in reason
    assert torch.equal(store.state, before[0])
    assert all(torch.equal(optimizer.state[k], v) for k, v in before[1].items())


def _refused(guard: GradientGuard, report: StageReport, task_id: int, worker_id: int = 1) -> str:
    with pytest.raises(ProtocolError) as refused:
        guard.check(report, task_id, worker_id)
    return f"{refused.value.code.name}: {refused.value}"


def test_the_guard_refuses_outliers_and_clips_only_when_asked() -> None:
    guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
    normal = StageReport(True, 4.0, 0.01)
    for task in range(GUARD_WARMUP):
        assert guard.check(normal, task, 1) == 1.0  # never clipped by default
    text = _refused(guard, StageReport(True, 4.0 * 200**2, 0.01), 20)  # norm 400, typical 2
    assert text.startswith("REFUSED") and "200" not in text  # the limit is not told
    assert _refused(guard, StageReport(False, 0.0, 0.0), 21).startswith("NON_FINITE")
    assert guard.check(StageReport(True, 4.0 * 50**2, 0.01), 22, 1) == 1.0  # large, plausible
    clipping = GradientGuard(max_grad_norm=1.0, outlier_factor=100.0)
    assert clipping.check(normal, 1, 1) == pytest.approx(0.5)  # norm 2 clipped to 1


def test_an_overflowing_norm_is_non_finite_and_never_enters_the_window() -> None:
    """Entries of 1e20 are finite, but their float32 sum of squares is not: refused as
    NON_FINITE every time (never taken clipped), and the typical norm stays what it was."""
    guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
    for task in range(GUARD_WARMUP):
        guard.check(StageReport(True, 4.0, 0.01), task, 1)
    for kind in (StageReport(True, math.inf, 0.01), StageReport(True, 4.0, math.inf)):
        for _ in range(REFUSALS_BEFORE_CLIP + 1):
            assert _refused(guard, kind, 30).startswith("NON_FINITE")
    assert guard.check(StageReport(True, 4.0 * 90**2, 0.01), 31, 1) == 1.0  # limit 200 holds
    assert guard.clipped == 0


def test_one_member_of_two_can_neither_shrink_the_limit_to_nothing_nor_grow_it() -> None:
    """All-zero pushes of one member take the typical norm no lower than the floor, so an
    honest member's pushes stay accepted; huge accepted norms of one member (alone first,
    then beside an honest member) do not raise the limit above the honest member's."""
    for attack, limit in ((0.0, 100.0 * NORM_FLOOR), (1e6, 100.0 * 2.0)):
        guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
        for task in range(200):
            with contextlib.suppress(ProtocolError):
                guard.check(StageReport(True, attack**2, attack**2), task, 2)
            if task >= 100:
                assert guard.check(StageReport(True, 4.0, 0.01), 1000 + task, 1) == 1.0
        assert _refused(guard, StageReport(True, (1.01 * limit) ** 2, 0.0), 5000, 2)
        assert guard.check(StageReport(True, (0.99 * limit) ** 2, 0.0), 5001, 1) == 1.0
    guard.forget(1)  # a member that left no longer counts: the attacker's norms are typical
    assert guard.check(StageReport(True, 1e12, 0.0), 5002, 1) == 1.0


def test_the_guard_takes_a_task_refused_repeatedly_clipped_to_the_typical_norm() -> None:
    """A gradient recomputed on fresh parameters keeps its norm; in a sync round the
    parameters cannot change until the round closes, so refusing it forever would stall
    training: the third try is taken, clipped to the typical norm (not to the limit). A
    buffer change is judged the same way."""
    guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
    normal = StageReport(True, 4.0, 0.25)  # norms 2 and 0.5
    for task in range(GUARD_WARMUP):
        guard.check(normal, task, 1)
    for task, outlier, factor in (
        (10, StageReport(True, 400.0**2, 0.25), 2 / 400),  # gradient norm 400, limit 200
        (20, StageReport(True, 4.0, 100.0**2), 0.5 / 100),  # buffer change 100, limit 50
    ):
        for _ in range(REFUSALS_BEFORE_CLIP - 1):
            assert _refused(guard, outlier, task).startswith("REFUSED")
        _refused(guard, outlier, task + 1)  # another task starts its own count
        assert guard.check(outlier, task, 1) == pytest.approx(factor)  # taken at the typical
        _refused(guard, outlier, task)  # the count starts again after it was taken
        guard.check(normal, task + 2, 1)
    assert guard.clipped == 2


def test_a_member_refused_again_and_again_is_struck_out() -> None:
    guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
    for task in range(GUARD_WARMUP):
        guard.check(StageReport(True, 4.0, 0.01), task, 1)
    outlier = StageReport(True, 400.0**2, 0.01)
    for task in range(STRIKES_BEFORE_DROP // 2):  # clipped pushes do not wipe the slate
        assert not guard.struck_out(2)
        for _ in range(REFUSALS_BEFORE_CLIP - 1):
            _refused(guard, outlier, task, 2)
        guard.check(outlier, task, 2)
        guard.check(StageReport(True, 4.0, 0.01), 1000 + task, 1)  # another member is fine
    assert guard.struck_out(2) and not guard.struck_out(1)
    guard.forget(2)
    assert not guard.struck_out(2)


class _Replies:
    """Records what a store service answers."""

    def __init__(self) -> None:
        self.errors: list[tuple[int, ErrorCode]] = []

    def reply(
        self, identity: bytes, request_id: int, message: object, lease: object = None
    ) -> None:
        raise AssertionError(f"request {request_id} answered with {message!r}")

    def reply_error(self, identity: bytes, request_id: int, code: ErrorCode, text: str) -> None:
        self.errors.append((request_id, code))


async def test_an_update_the_store_refuses_answers_its_chunks_and_keeps_nothing_staged() -> None:
    """The store that finds a candidate invalid has none to abort: the update's gradients are
    dropped all the same, their chunks answered, and the tasks closed (their samples are handed
    out again under new tasks)."""
    tokens, replies = TokenBook(new_key()), _Replies()
    service = StoreService(_store(), "fp32", tokens=tokens, replier=replies, pull_timeout_s=1.0)
    bad = torch.zeros(4096)
    bad[3072:] = -10.0  # the running variances would become negative
    for task_id in (1, 2):  # two refused updates of one worker, then an honest push
        for request_id, offset in enumerate(range(0, 4096, 1024)):
            chunk = GradientChunk(
                worker_id=7, token=tokens.push_token(7, task_id), task_id=task_id, version=0,
                offset=offset, scale=1.0, gradient=bad[offset : offset + 1024].numpy(),
            )  # fmt: skip
            await service.on_gradient_chunk(b"w", 10 * task_id + request_id, chunk)
        assert await service.prepare(1, [task_id], [1.0], 1.0, 1.0) == (
            False,
            "the update makes a running variance negative",
        )
        await service.abort(1, ErrorCode.REFUSED, "refused")
        assert not service.store.staged
        assert replies.errors[-4:] == [(10 * task_id + i, ErrorCode.REFUSED) for i in range(4)]
        with pytest.raises(ProtocolError) as late:  # a replayed chunk of the refused task
            await service.on_gradient_chunk(b"w", 99, chunk)
        assert late.value.code == ErrorCode.WRONG_TASK
    good = GradientChunk(
        worker_id=7, token=tokens.push_token(7, 3), task_id=3, version=0, offset=0, scale=1.0,
        gradient=torch.zeros(1024).numpy(),
    )  # fmt: skip
    await service.on_gradient_chunk(b"w", 30, good)
    assert set(service.store.staged) == {3}
    service.stop("the test ends")


def test_the_chunks_a_dropped_push_still_owes_are_refused_once_each() -> None:
    """A push dropped before all its chunks came (they are on their way: a worker sends every
    chunk before its push): each missing chunk is refused once with the push's error when it
    comes, and the next push of the task, even on the same version, is staged whole."""
    store, chunk = _store(), torch.ones(1024)
    incomplete = ProtocolError(ErrorCode.INCOMPLETE, "did not fully arrive")
    store.stage(1, 7, 0, 0, 1.0, chunk)
    store.drop([1], incomplete)
    store.drop([1], ProtocolError(ErrorCode.WRONG_TASK, "again"))  # nothing staged: kept
    for offset in (1024, 2048, 3072):  # the late chunks of the dropped push
        with pytest.raises(ProtocolError) as late:
            store.stage(1, 7, 0, offset, 1.0, chunk)
        assert late.value is incomplete
    assert not store.staged and not store.late[1].offsets
    for offset in range(0, 4096, 1024):  # the next push of the task, on the same version
        staged = store.stage(1, 7, 0, offset, 1.0, chunk)
    assert staged.complete(store.size)
    # A push found INCOMPLETE with none of its chunks here: every one is awaited, of any
    # version; a drop without refusal (the task closed) forgets them.
    store.drop([1], incomplete)
    store.drop([2], incomplete)
    with pytest.raises(ProtocolError):
        store.stage(2, 7, 0, 0, 1.0, chunk)
    assert set(store.late) == {2} and store.late[2].offsets == {1024, 2048, 3072}
    store.drop([2])
    store.stage(2, 7, 5, 1024, 1.0, chunk)
    assert not store.late and set(store.staged) == {2}


@pytest.mark.parametrize("delivered", [(0, 1024, 2048), ()])
def test_a_chunk_lost_on_the_way_is_refused_for_one_retry_only(delivered) -> None:
    """The chunk a dropped push still owed never comes (its connection broke): the retry's own
    chunk at that offset is refused in its place, the retry is dropped in turn, and the next
    retry, on the same version, is staged whole: a lost chunk cannot refuse every retry."""
    store, chunk = _store(), torch.ones(1024)
    incomplete = ProtocolError(ErrorCode.INCOMPLETE, "did not fully arrive")
    for offset in delivered:
        store.stage(1, 7, 0, offset, 1.0, chunk)
    store.drop([1], incomplete)
    owed = set(range(0, 4096, 1024)) - set(delivered)
    for offset in range(0, 4096, 1024):  # the first retry: its owed chunks are refused
        if offset in owed:
            with pytest.raises(ProtocolError):
                store.stage(1, 7, 0, offset, 1.0, chunk)
        else:
            store.stage(1, 7, 0, offset, 1.0, chunk)
    store.drop([1], incomplete)
    for offset in range(0, 4096, 1024):  # the second retry
        staged = store.stage(1, 7, 0, offset, 1.0, chunk)
    assert staged.complete(store.size) and not store.late
