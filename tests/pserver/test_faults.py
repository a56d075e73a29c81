"""Faults against a live server: races between pushes and leaves, spoofed identities, absurd
values, restarts of sync training, memory bounds. Each was a hang, a crash or corrupted
parameters before the push path was rewritten."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import torch

from common.errors import ErrorCode, ProtocolError, RemoteError
from common.protocol.messages import (
    DataRequest,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
)
from common.protocol.tokens import TokenBook, new_key
from common.training.planner import plan_batches
from pserver.membership import Roster, WorkerInfo
from pserver.store import service as service_module
from tests.support.live import (
    clients,
    gradient_chunk,
    live_server,
    poll_until_async,
    published,
    push_request,
)

REPLY_S = 15.0


def _gradient(ps, value: float = 0.01) -> np.ndarray:
    return np.full(ps.state_size, value, dtype=np.float32)


async def _train_to_the_end(ps, client, member, epochs: int) -> None:
    """Push every task ``member`` gets until training ends; each of the ``epochs`` epochs used
    every sample exactly once."""
    task = await client.request(
        TaskRequest(worker_id=member.worker_id, token=member.token, speed=100.0)
    )
    while isinstance(task, TaskReply) and task.action == "train":
        task = await asyncio.wait_for(client.push(member, task, _gradient(ps)), REPLY_S)
    done = [e for e in ps.log.events if e["event"] == "epoch"]
    assert len(done) == epochs and all(e["exactly_once"] for e in done)


async def _wait(predicate, timeout: float = REPLY_S) -> None:
    """Wait (bounded) until the server's state satisfies ``predicate``."""
    await poll_until_async(predicate, timeout, 0.01, "the server's state")


@pytest.mark.parametrize("mode", ["weighted-sync", "async"])
async def test_a_nan_push_racing_a_leave_gives_its_samples_back_once(small_hsi, mode) -> None:
    async with (
        live_server(small_hsi, mode=mode, workers=2, global_batch=30, epochs=3) as ps,
        clients(ps.address, 3) as (a, b, a_leave),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(
            a.join("a", speed=200.0), b.join("b", speed=100.0)
        )
        nan = _gradient(ps)
        nan[3] = np.nan
        # The push is announced first, so the server is waiting for its gradient when the
        # leave arrives; the NaN chunks come last.
        push = await a.send(push_request(member_a, task_a))
        await _wait(lambda: ps.roster.workers[member_a.worker_id].pushing is not None)
        await a_leave.request(
            LeaveRequest(worker_id=member_a.worker_id, token=member_a.token, reason="bye")
        )
        await a.send_gradient(member_a, task_a, nan)
        with pytest.raises(RemoteError) as refused:
            await a.receive(push)
        assert refused.value.code == ErrorCode.WRONG_TASK  # withdrawn: its worker left
        # b trains on alone: every round closes and every epoch uses each sample once.
        task = task_b
        while True:
            reply = await asyncio.wait_for(b.push(member_b, task, _gradient(ps)), REPLY_S)
            assert isinstance(reply, TaskReply)
            if reply.action == "stop":
                break
            task = reply
        epochs = [e for e in ps.log.events if e["event"] == "epoch"]
        assert [e["epoch"] for e in epochs] == [1, 2, 3]
        assert all(e["exactly_once"] for e in epochs)
        assert ps.run.finish_reason == "epochs"


async def test_sync_training_restarts_after_every_worker_left(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=1, global_batch=16, epochs=50) as ps,
        clients(ps.address, 2) as (first, second),
    ):
        member, task = await first.join("only")
        await first.push(member, task, _gradient(ps))
        await first.request(
            LeaveRequest(worker_id=member.worker_id, token=member.token, reason="ctrl-c")
        )
        # its planned rounds wait, their samples kept, for the next worker to take them
        assert ps.policy.rounds and all(not r.tasks and r.orphans for r in ps.policy.rounds)
        version = ps.updater.version
        newcomer, task = await asyncio.wait_for(second.join("newcomer"), REPLY_S)
        reply = await second.push(newcomer, task, _gradient(ps))
        assert isinstance(reply, TaskReply) and reply.action == "train"
        assert ps.updater.version == version + 1


async def test_another_connection_cannot_act_for_a_worker(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=2, global_batch=20, epochs=20) as ps,
        clients(ps.address, 3) as (a, b, spoofer),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(
            a.join("a", speed=100.0), b.join("b", speed=100.0)
        )
        wid = member_a.worker_id
        forged = "0" * 32
        for message in (
            LeaveRequest(worker_id=wid, token=forged, reason="spoofed"),
            HeartbeatRequest(worker_id=wid, token=forged),
            TaskRequest(worker_id=wid, token=forged, speed=1.0),
            DataRequest(worker_id=wid, token=forged, indices=task_a.indices),
            push_request(member_a, task_a, token=forged),
            push_request(member_a, task_a, token=member_b.token),  # b's token, a's id
        ):
            error = await spoofer.expect_error(message)
            assert error.code == ErrorCode.UNKNOWN_WORKER, (message.TYPE, error)
        stolen = await spoofer.send_gradient(member_a, task_a, _gradient(ps), token=forged)
        with pytest.raises(RemoteError):
            await stolen[0][0].receive(stolen[0][1])
        assert sorted(w.name for w in ps.roster.members()) == ["a", "b"]  # joined in any order
        replies = await asyncio.gather(
            a.push(member_a, task_a, _gradient(ps)), b.push(member_b, task_b, _gradient(ps))
        )
        assert all(isinstance(r, TaskReply) and r.action == "train" for r in replies)
        assert ps.updater.version == 1


@pytest.mark.parametrize("speed", [1e308, 1e12, 0.0, -5.0])
async def test_absurd_speeds_are_refused_and_training_goes_on(small_hsi, speed) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=2, global_batch=20, epochs=20) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        error = await a.expect_error(
            TaskRequest(worker_id=member_a.worker_id, token=member_a.token, speed=speed)
        )
        assert error.code == ErrorCode.BAD_FIELD
        with pytest.raises(RemoteError) as refused:
            await a.push(member_a, task_a, _gradient(ps), speed=speed)
        assert refused.value.code == ErrorCode.BAD_FIELD
        replies = await asyncio.gather(
            a.push(member_a, task_a, _gradient(ps)), b.push(member_b, task_b, _gradient(ps))
        )
        assert all(isinstance(r, TaskReply) for r in replies) and ps.updater.version == 1


def test_the_planner_takes_any_positive_speeds() -> None:
    for speeds in (
        {1: 1e308, 2: 1e308, 3: 1.0},
        {1: 5e-324, 2: 1.0},
        {1: 1e9, 2: 1e-6},
        {1: math.nextafter(0, 1), 2: math.nextafter(0, 1)},
    ):
        sizes = plan_batches(speeds, 64)
        assert sum(sizes.values()) == 64 and min(sizes.values()) >= 1, (speeds, sizes)


@pytest.mark.parametrize(
    "case", ["one huge entry", "huge everywhere", "negative variance", "momentum overflow"]
)
async def test_finite_but_absurd_pushes_never_corrupt_the_parameters(small_hsi, case) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=1, global_batch=20, epochs=20) as ps,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("w")
        # Some honest pushes first, so the guard knows what normal looks like.
        for _ in range(10):
            task = await client.push(member, task, _gradient(ps, 0.001))
        before, version = published(ps), ps.updater.version
        bad = _gradient(ps, 0.001)
        if case == "one huge entry":
            bad[5] = 3e38
        elif case == "huge everywhere":
            bad[:] = 1e30
        elif case == "negative variance":
            start, stop = ps.nonneg[0], ps.nonneg[1]
            bad[start:stop] = -1e3  # running variances would go far below zero
        else:  # momentum overflow: two finite pushes whose sum is beyond float32
            bad[: ps.num_params] = 3e38
        with pytest.raises(RemoteError) as refused:
            await client.push(member, task, bad)
        assert refused.value.code in (ErrorCode.REFUSED, ErrorCode.NON_FINITE)
        assert ps.updater.version == version and torch.equal(published(ps), before)
        assert bool(torch.isfinite(published(ps)).all())
        again = await client.request(
            TaskRequest(worker_id=member.worker_id, token=member.token, speed=100.0)
        )
        assert isinstance(again, TaskReply)
        reply = await client.push(member, again, _gradient(ps, 0.001))
        assert isinstance(reply, TaskReply) and ps.updater.version == version + 1
        text = json.dumps(list(ps.log.events), allow_nan=False)  # no bare NaN can reach the log
        assert "NaN" not in text


async def test_data_requests_are_bounded(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=1, epochs=20) as ps,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("w")
        repeated = [task.indices[0]] * 131_072
        error = await client.expect_error(
            DataRequest(worker_id=member.worker_id, token=member.token, indices=repeated)
        )
        assert error.code == ErrorCode.BAD_FIELD and "per data request" in str(error)


async def test_departed_members_are_forgotten_and_joins_are_capped(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=1, epochs=20, max_workers=8) as ps,
        clients(ps.address, 1) as (client,),
    ):
        for i in range(300):
            join = await client.request(
                JoinRequest(name=f"n{i % 40}", device="cpu", slowdown=1.0, threads=1)
            )
            await client.request(
                LeaveRequest(worker_id=join.worker_id, token=join.token, reason="churn")
            )
        assert len(ps.roster.workers) == 0 and len(ps.roster.history) <= 40
        status = await client.request(StatusRequest())
        assert isinstance(status, StatusReply)
        assert len(json.dumps(status.status)) < 20_000
        for i in range(8):
            await client.request(JoinRequest(name=f"m{i}", device="cpu", slowdown=1.0, threads=1))
        error = await client.expect_error(
            JoinRequest(name="ninth", device="cpu", slowdown=1.0, threads=1)
        )
        assert error.code == ErrorCode.BUSY


async def test_unread_status_replies_do_not_starve_a_worker(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=1, epochs=20) as ps,
        clients(ps.address, 2) as (worker, flooder),
    ):
        member, task = await worker.join("w")
        for _ in range(500):  # never read
            await flooder.send(StatusRequest())
        loop = asyncio.get_running_loop()
        begin = loop.time()
        await worker.request(HeartbeatRequest(worker_id=member.worker_id, token=member.token))
        assert loop.time() - begin < ps.config.dead_after_s / 2
        reply = await worker.push(member, task, _gradient(ps))
        assert isinstance(reply, TaskReply) and member.worker_id in ps.roster.workers


async def test_a_stale_push_racing_a_leave_is_booked_once(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=2, epochs=2, max_staleness=0) as ps,
        clients(ps.address, 3) as (a, b, b_leave),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        await a.push(member_a, task_a, _gradient(ps))  # b's task is now one version stale
        push = await b.send(push_request(member_b, task_b))
        await _wait(lambda: ps.roster.workers[member_b.worker_id].pushing is not None)
        await b_leave.request(
            LeaveRequest(worker_id=member_b.worker_id, token=member_b.token, reason="bye")
        )
        await b.send_gradient(member_b, task_b, _gradient(ps))
        with pytest.raises(RemoteError) as refused:
            await b.receive(push)
        assert refused.value.code == ErrorCode.WRONG_TASK
        await _train_to_the_end(ps, a, member_a, epochs=2)


async def test_eval_every_zero_evaluates_only_at_the_end(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", workers=1, global_batch=8, epochs=3, eval_every=0)
        as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("fast")
        while task.action == "train":
            task = await client.push(member, task, _gradient(ps, 1e-4))
        await _wait(lambda: bool(ps.run.evals), 60)
    evals = [e for e in ps.log.events if e["event"] == "eval"]
    assert len([e for e in ps.log.events if e["event"] == "epoch"]) == 3
    assert len(evals) == 1 and evals[0]["version"] == ps.updater.version


async def test_evaluations_keep_up_by_skipping_superseded_versions(small_hsi) -> None:
    async with (
        live_server(
            small_hsi, mode="async", workers=1, global_batch=4, epochs=3, eval_every_updates=1,
            eval_samples=200,
        ) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("fast")
        while task.action == "train":  # an update per push, far faster than an evaluation
            task = await client.push(member, task, _gradient(ps, 1e-4))
        await _wait(lambda: ps.run.evals and ps.run.evals[-1]["test_samples"] > 200, 60)
    evals = [e for e in ps.log.events if e["event"] == "eval"]
    assert ps.evaluations.skipped > 0 and len(evals) < ps.updater.version
    assert all(e["test_samples"] == 200 for e in evals[:-1])  # the fixed stratified subset
    assert evals[-1]["version"] == ps.updater.version  # the final one: whole test split
    assert evals[-1]["test_samples"] == len(ps.reader.test_indices)
    times = [e["t"] for e in ps.log.events]
    assert times == sorted(times)  # metrics.jsonl stays in time order


async def test_a_silent_member_is_dead_after_dead_after_and_a_talking_one_never() -> None:
    """Every message pushes a member's deadline on; one that keeps talking outlives several
    deadlines, one that is silent (from its join, or after its last message) is handed to
    ``on_dead`` once ``dead_after_s`` passed, within a bounded slack; one that left, never."""
    dead_after_s, slack_s = 1.0, 5.0
    loop = asyncio.get_running_loop()
    dead: dict[str, float] = {}
    both = asyncio.Event()

    def on_dead(worker: WorkerInfo) -> None:
        dead[worker.name] = loop.time()
        roster.remove(worker)
        if len(dead) == 2:
            both.set()

    roster = Roster(dead_after_s, on_dead, tokens=TokenBook(new_key()), max_members=8)
    joined = loop.time()
    talker, _, leaver = (roster.add(name, "cpu", 1.0, 1) for name in ("talker", "silent", "left"))
    roster.remove(leaver)
    talked, last = asyncio.Event(), [0.0]

    def talk(times: int) -> None:  # a message every fifth of a deadline, ten times
        last[0] = loop.time()
        roster.touch(talker)
        if times:
            loop.call_later(dead_after_s / 5, talk, times - 1)
        else:
            talked.set()

    talk(10)
    await asyncio.wait_for(talked.wait(), REPLY_S)
    assert "talker" not in dead and loop.time() - joined > 2 * dead_after_s
    await asyncio.wait_for(both.wait(), REPLY_S)
    assert dead_after_s <= dead["silent"] - joined < dead_after_s + slack_s
    assert dead_after_s <= dead["talker"] - last[0] < dead_after_s + slack_s
    roster.close()
    assert set(dead) == {"talker", "silent"}


async def test_chunks_of_a_task_withdrawn_from_a_worker_that_left_are_refused(small_hsi) -> None:
    """A member that left (or was dropped) still holds its push tokens: chunks of its task
    sent after it left are refused, not kept staged with their replies waiting for good."""
    async with (
        live_server(small_hsi, mode="async", workers=1, epochs=50, chunk_mb=0.01) as ps,
        clients(ps.address, 2) as (keeper, leaver),
    ):
        await keeper.join("keeper")
        member, task = await leaver.join("leaver")
        await leaver.request(
            LeaveRequest(worker_id=member.worker_id, token=member.token, reason="done")
        )
        gradient = np.full(ps.state_size, 1e-4, np.float32)
        sent = await leaver.send_gradient(member, task, gradient)
        assert len(sent) > 1
        for store, rid in sent:
            with pytest.raises(RemoteError) as refused:
                await store.receive(rid)
            assert refused.value.code == ErrorCode.WRONG_TASK
        assert not ps.stores.store.staged  # type: ignore[union-attr]


async def test_a_chunk_that_comes_while_a_departed_workers_task_is_dropped_is_refused(
    small_hsi, monkeypatch
) -> None:
    """The task is closed before its store forgets the staged gradients (off the loop): a
    chunk that comes meanwhile is refused, not staged after them with no reply ever due."""
    monkeypatch.setattr(service_module, "INLINE_ELEMS", 0)  # the store works on its thread
    async with (
        live_server(small_hsi, mode="async", workers=1, epochs=50, chunk_mb=0.01) as ps,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("leaver")
        service = ps.stores
        assert isinstance(service, service_module.StoreService)
        start, stop = service.store.spans[0]
        chunk = gradient_chunk(member, task, start, np.full(stop - start, 1e-4, np.float32))
        dropping = asyncio.create_task(
            service.drop([task.task_id], ErrorCode.UNKNOWN_WORKER, "the worker left")
        )
        await asyncio.sleep(0)  # the drop waits for the store's thread
        with pytest.raises(ProtocolError) as refused:
            await service.on_gradient_chunk(b"leaver", 1, chunk)
        assert refused.value.code == ErrorCode.WRONG_TASK
        await asyncio.wait_for(dropping, 10)
        assert not service.store.staged


async def test_a_stale_push_whose_worker_left_while_it_waited_gives_its_samples_back(
    small_hsi,
) -> None:
    """The push was accepted and waits while another update (or a checkpoint) holds the lock;
    its worker leaves meanwhile, then the push is refused as too stale: nobody recomputes its
    task, so its samples go back and the epoch still uses each sample once."""
    async with (
        live_server(small_hsi, mode="async", workers=2, epochs=2, max_staleness=0) as ps,
        clients(ps.address, 3) as (a, b, b_leave),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        await a.push(member_a, task_a, _gradient(ps))  # b's task is now one version stale
        worker_b = ps.roster.workers[member_b.worker_id]
        async with ps.updater.lock:  # an update being published
            push = await b.send(push_request(member_b, task_b))
            await b.send_gradient(member_b, task_b, _gradient(ps))
            await _wait(lambda: worker_b.waiter is not None)  # accepted: waits for the lock
            assert all(t.task_id != task_b.task_id for t in worker_b.tasks)
            await b_leave.request(
                LeaveRequest(worker_id=member_b.worker_id, token=member_b.token, reason="bye")
            )
        with pytest.raises(RemoteError) as refused:
            await b.receive(push)
        assert refused.value.code == ErrorCode.STALE
        await _train_to_the_end(ps, a, member_a, epochs=2)
        assert ps.run.finish_reason == "epochs"


@pytest.mark.parametrize("published_meanwhile", [False, True])
async def test_a_chunk_that_comes_after_its_push_was_incomplete_is_answered_and_not_kept(
    small_hsi, published_meanwhile
) -> None:
    """A push refused as INCOMPLETE: the chunk it waited for comes afterwards. It is answered
    at once and not kept, so the worker's next push of the task (on the same parameters, or on
    newer ones) is staged whole and applied."""
    async with (
        live_server(
            small_hsi, mode="async", workers=2, epochs=50, chunk_mb=0.01, stage_timeout_s=0.5
        ) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        (member, task), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        service = ps.stores
        assert isinstance(service, service_module.StoreService)
        gradient = _gradient(ps, 1e-4)
        *early, (start, stop) = service.store.spans  # the last chunk comes late
        sent = [await a.send(gradient_chunk(member, task, lo, gradient[lo:hi])) for lo, hi in early]
        with pytest.raises(RemoteError) as incomplete:
            await a.request(push_request(member, task))
        assert incomplete.value.code == ErrorCode.INCOMPLETE
        for rid in sent:
            with pytest.raises(RemoteError) as answered:
                await a.receive(rid)
            assert answered.value.code == ErrorCode.INCOMPLETE
        late = await a.send(gradient_chunk(member, task, start, gradient[start:stop]))
        with pytest.raises(RemoteError) as answered:
            await asyncio.wait_for(a.receive(late), REPLY_S)
        assert answered.value.code == ErrorCode.INCOMPLETE
        assert not service.store.staged
        if published_meanwhile:  # the task comes back on newer parameters
            await b.push(member_b, task_b, gradient)
        again = await a.request(
            TaskRequest(worker_id=member.worker_id, token=member.token, speed=100.0)
        )
        assert isinstance(again, TaskReply) and again.task_id == task.task_id
        assert again.version == ps.updater.version
        version = ps.updater.version
        reply = await asyncio.wait_for(a.push(member, again, gradient), REPLY_S)
        assert isinstance(reply, TaskReply) and reply.action == "train"
        assert ps.updater.version == version + 1
        assert not service.store.staged
