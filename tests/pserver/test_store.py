"""Parameter-store parts: buffer leases, staging rules, two-phase publish, the gradient guard."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ErrorCode, ProtocolError
from pserver.store.optimizer import FlatOptimizer
from pserver.store.pool import BufferPool
from pserver.store.service import StageReport
from pserver.store.slices import SliceStore
from pserver.updates import GUARD_WARMUP, REFUSALS_BEFORE_CLIP, GradientGuard


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
    return SliceStore(0, size, num_params, state, optimizer, [num_params, size], 1024)


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
        store.commit(1)


def test_the_guard_refuses_outliers_and_clips_only_when_asked() -> None:
    guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
    normal = StageReport(True, 4.0, 0.01)
    for _ in range(GUARD_WARMUP):
        assert guard.check(normal, 1) == 1.0  # never clipped by default
    with pytest.raises(ProtocolError) as refused:
        guard.check(StageReport(True, 4.0 * 200**2, 0.01), 2)  # norm 400 against a median of 2
    assert refused.value.code == ErrorCode.REFUSED
    with pytest.raises(ProtocolError) as refused:
        guard.check(StageReport(False, 0.0, 0.0), 3)
    assert refused.value.code == ErrorCode.NON_FINITE
    assert guard.check(StageReport(True, 4.0 * 50**2, 0.01), 4) == 1.0  # large, but plausible
    clipping = GradientGuard(max_grad_norm=1.0, outlier_factor=100.0)
    assert clipping.check(normal, 1) == pytest.approx(0.5)  # norm 2 clipped to 1


def test_the_guard_takes_a_task_refused_repeatedly_clipped_to_the_limit() -> None:
    """A gradient recomputed on fresh parameters keeps its norm; in a sync round the
    parameters cannot change until the round closes, so refusing it forever would stall
    training: the third try is taken, clipped to the limit."""
    guard = GradientGuard(max_grad_norm=None, outlier_factor=100.0)
    normal = StageReport(True, 4.0, 0.01)  # norm 2
    for _ in range(GUARD_WARMUP):
        guard.check(normal, task_id=1)
    outlier = StageReport(True, 400.0**2, 0.01)  # norm 400 against a limit of 200
    for _ in range(REFUSALS_BEFORE_CLIP - 1):
        with pytest.raises(ProtocolError) as refused:
            guard.check(outlier, task_id=7)
        assert refused.value.code == ErrorCode.REFUSED
    with pytest.raises(ProtocolError):
        guard.check(outlier, task_id=8)  # another task starts its own count
    assert guard.check(outlier, task_id=7) == pytest.approx(0.5)  # taken, clipped to 200
    assert guard.clipped == 1 and guard.refused == REFUSALS_BEFORE_CLIP
    with pytest.raises(ProtocolError):
        guard.check(outlier, task_id=7)  # the count starts again after it was taken
    bad_buffers = StageReport(True, 4.0, 1e6)
    for _ in range(REFUSALS_BEFORE_CLIP + 1):  # buffer changes are never clipped: refused
        with pytest.raises(ProtocolError):
            guard.check(bad_buffers, task_id=9)
