"""A live server on 127.0.0.1 against scripted clients: hostile input, staleness, replays."""

from __future__ import annotations

import asyncio
import logging
import threading

import msgpack
import numpy as np
import pytest
import torch

from common.errors import ErrorCode, RemoteError
from common.protocol.ending import FinishReason
from common.protocol.messages import (
    REPLIES,
    DataReply,
    DataRequest,
    JoinRequest,
    LeaveRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
    parse_message,
)
from common.protocol.wire import PROTOCOL_VERSION
from tests.support.live import (
    REPLY_TIMEOUT_S,
    AsyncClient,
    clients,
    live_server,
    poll_until_async,
    published,
    push_request,
)


def _raw_header(**fields) -> bytes:
    base = {"v": PROTOCOL_VERSION, "type": "status_request", "id": 5, "body": {}, "tensors": []}
    base.update(fields)
    return msgpack.packb(base)


RAW_ATTACKS = {
    "garbage bytes": ([b"\x00\xffnot msgpack at all"], ErrorCode.BAD_FRAME),
    "truncated msgpack": ([_raw_header()[:-4]], ErrorCode.BAD_FRAME),
    "non-map header": ([msgpack.packb("hello")], ErrorCode.BAD_FRAME),
    "unknown type": ([_raw_header(type="drop_tables")], ErrorCode.UNKNOWN_TYPE),
    "wrong protocol version": ([_raw_header(v=PROTOCOL_VERSION + 1)], ErrorCode.BAD_VERSION),
    "frame length disagrees": (
        [_raw_header(tensors=[{"dtype": "float32", "shape": [100]}]), b"\x00" * 12],
        ErrorCode.BAD_TENSOR,
    ),
    "object dtype": (
        [_raw_header(tensors=[{"dtype": "object", "shape": [2]}]), b"\x00" * 16],
        ErrorCode.BAD_TENSOR,
    ),
}


async def test_hostile_input_gets_error_replies_and_leaves_parameters_unchanged(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=100) as ps,
        clients(ps.address, 2) as (client, attacker),
    ):
        member, task = await client.join("honest")
        worker_id = member.worker_id
        size = ps.state_size
        before = published(ps)
        version = ps.updater.version

        for name, (frames, code) in RAW_ATTACKS.items():
            reply = msgpack.unpackb((await attacker.send_raw(frames))[0])
            assert reply["status"] == "error" and reply["code"] == code, (name, reply)

        good = np.zeros(size, dtype=np.float32)
        nan = good.copy()
        nan[size // 2] = np.nan
        inf = good.copy()
        inf[0] = np.inf
        token = member.token
        # Pushes whose gradient is bad: the push is refused with the gradient's error code.
        for gradient, code in ((nan, ErrorCode.NON_FINITE), (inf, ErrorCode.NON_FINITE)):
            with pytest.raises(RemoteError) as refused:
                await attacker.push(member, task, gradient)
            assert refused.value.code == code
        chunk_cases = [
            (dict(gradient=good[:-1]), ErrorCode.BAD_TENSOR),
            (dict(gradient=good[: 1 << 10].astype(np.float64)), ErrorCode.BAD_TENSOR),
            (dict(token="0" * 32), ErrorCode.WRONG_TASK),
            (dict(offset=7), ErrorCode.BAD_TENSOR),
        ]
        for change, code in chunk_cases:
            store, rid = (await attacker.send_gradient(member, task, good, **change))[0]
            with pytest.raises(RemoteError) as refused:
                await store.receive(rid)
            assert refused.value.code == code, (change, refused.value)
        cases = [
            (push_request(member, task, task_id=task.task_id + 100), ErrorCode.WRONG_TASK),
            (push_request(member, task, batch_size=len(task.indices) + 1), ErrorCode.BAD_FIELD),
            (push_request(member, task, version=10**6), ErrorCode.BAD_FIELD),
            (push_request(member, task, worker_id=worker_id + 50), ErrorCode.UNKNOWN_WORKER),
            (push_request(member, task, token="f" * 32), ErrorCode.UNKNOWN_WORKER),
            (DataRequest(worker_id=worker_id, token=token, indices=[-1]), ErrorCode.BAD_FIELD),
            (
                DataRequest(
                    worker_id=worker_id, token=token, indices=[int(ps.reader.test_indices[0])]
                ),
                ErrorCode.BAD_FIELD,
            ),
            (JoinRequest(name="", device="cpu", slowdown=1.0, threads=1), ErrorCode.BAD_FIELD),
            (TaskRequest(worker_id=worker_id, token=token, speed=-1.0), ErrorCode.BAD_FIELD),
        ]
        for message, code in cases:
            error = await attacker.expect_error(message)
            assert error.code == code, (message.TYPE, error)

        assert ps.updater.version == version
        assert torch.equal(published(ps), before)
        status = await attacker.request(StatusRequest())
        assert isinstance(status, StatusReply) and status.status["version"] == version

        data = await client.request(
            DataRequest(worker_id=worker_id, token=token, indices=task.indices)
        )
        assert isinstance(data, DataReply) and data.x.shape[0] == len(task.indices)
        again = await client.request(TaskRequest(worker_id=worker_id, token=token, speed=50.0))
        assert isinstance(again, TaskReply) and again.task_id == task.task_id
        nxt = await client.push(member, task, good)
        assert isinstance(nxt, TaskReply) and nxt.version == version + 1
        replay = await client.expect_error(push_request(member, task))
        assert replay.code == ErrorCode.WRONG_TASK
        assert ps.updater.version == version + 1


async def test_max_staleness_rejects_old_pushes_and_the_worker_re_pulls(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=100, max_staleness=0) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        member_a, task_a = await a.join("a")
        member_b, task_b = await b.join("b")
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        await a.push(member_a, task_a, zeros)  # version 0 -> 1
        state = published(ps)
        with pytest.raises(RemoteError) as stale:  # computed on 0: tau = 1 > 0
            await b.push(member_b, task_b, zeros)
        assert stale.value.code == ErrorCode.STALE
        assert torch.equal(published(ps), state) and ps.updater.version == 1
        again = await b.request(
            TaskRequest(worker_id=member_b.worker_id, token=member_b.token, speed=100.0)
        )
        assert isinstance(again, TaskReply)
        assert again.task_id == task_b.task_id and again.version == 1
        assert again.indices == task_b.indices
        fresh = await b.push(member_b, again, zeros)
        assert isinstance(fresh, TaskReply) and ps.updater.version == 2


@pytest.mark.parametrize("mode", ["weighted-sync", "equal-sync"])
async def test_sync_round_waits_for_every_worker_then_replies_to_all(small_hsi, mode) -> None:
    async with (
        live_server(small_hsi, mode=mode, workers=2, global_batch=30) as ps,
        clients(ps.address, 2) as (fast, slow),
    ):
        (member_f, task_f), (member_s, task_s) = await asyncio.gather(
            fast.join("f", speed=200.0), slow.join("s", speed=100.0)
        )
        sizes = [len(task_f.indices), len(task_s.indices)]
        assert sum(sizes) == 30
        assert sizes == ([20, 10] if mode == "weighted-sync" else [15, 15])
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        first = asyncio.create_task(fast.push(member_f, task_f, zeros))
        done, _ = await asyncio.wait({first}, timeout=0.5)
        assert not done, "the round closed before the slow worker pushed"
        assert [w.worker_id for w, _ in ps.policy.rounds[0].received.values()] == [
            member_f.worker_id
        ]
        assert ps.updater.version == 0
        second = await slow.push(member_s, task_s, zeros)
        assert (await first).version == second.version == 1


async def test_a_push_that_arrived_counts_even_if_its_worker_then_leaves(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=2, global_batch=30) as ps,
        clients(ps.address, 3) as (a, b, a_again),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(
            a.join("a", speed=200.0), b.join("b", speed=100.0)
        )
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        waiting = asyncio.create_task(a.push(member_a, task_a, zeros))
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done and [w.worker_id for w, _ in ps.policy.rounds[0].received.values()] == [
            member_a.worker_id
        ]
        await a_again.request(
            LeaveRequest(worker_id=member_a.worker_id, token=member_a.token, reason="bye")
        )
        reply = await b.push(member_b, task_b, zeros)
        assert isinstance(reply, TaskReply) and ps.updater.version == 1
        ledger = ps.sampler.ledgers[1]
        assert ledger.applied == 30  # a's 20 samples count: its gradient is in the update
        workers = {str(w["name"]): w for w in ps.roster.summaries()}
        assert workers["a"]["samples"] == len(task_a.indices) == 20
        waiting.cancel()


async def test_an_update_closed_after_training_ended_is_not_applied(small_hsi) -> None:
    """A push accepted just before the end must not change the parameters after it: the
    final checkpoint and summary would then disagree with them; its samples go back."""
    async with (
        live_server(small_hsi, mode="async", epochs=100) as ps,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("late")
        worker = ps.roster.workers[member.worker_id]
        handed_out = ps.sampler.ledgers[task.epoch].handed_out
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        async with ps.updater.lock:  # an update being applied holds the lock
            pushing = asyncio.create_task(client.push(member, task, zeros))
            # until the push is accepted and waits for the lock
            await poll_until_async(lambda: worker.waiter is not None, 10, 0.05, "a waiting push")
            ps.finish(FinishReason.STOPPED)
        reply = await asyncio.wait_for(pushing, 20)
        assert isinstance(reply, TaskReply) and reply.action == "stop"
        assert ps.updater.version == 0
        ledger = ps.sampler.ledgers[task.epoch]
        assert ledger.applied == 0
        assert ledger.handed_out == handed_out - len(task.indices)


async def test_a_worker_on_another_torch_is_named_in_a_warning_and_its_join_event(
    small_hsi, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=100) as ps,
        clients(ps.address, 1) as (client,),
    ):
        reply = await client.request(
            JoinRequest(name="old", device="cpu", slowdown=1.0, threads=1, torch_version="1.13.1")
        )
        assert reply.worker_id >= 0
        joins = [e for e in ps.log.events if e["event"] == "join"]
        assert joins[-1]["torch"] == "1.13.1"
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("torch 1.13.1" in w and torch.__version__ in w for w in warnings)


async def test_unread_data_is_bounded_per_worker_over_all_its_sockets(
    small_hsi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data replies still being read count against the bound, and so do the worker's other
    sockets: of 12 requests sent at once over 3 sockets, only the bound's worth is taken."""
    async with live_server(small_hsi, mode="async") as ps, clients(ps.address, 3) as socks:
        member, task = await socks[0].join("w")
        indices = [int(i) for i in task.indices]
        nbytes = len(indices) * ps.data._sample_bytes
        monkeypatch.setattr("pserver.handlers.MAX_IN_FLIGHT_BYTES", 3 * nbytes)
        release = threading.Event()
        read = ps.reader.read_stored
        monkeypatch.setattr(
            ps.reader, "read_stored", lambda i: (release.wait(REPLY_TIMEOUT_S), read(i))[1]
        )
        request = DataRequest(worker_id=member.worker_id, token=member.token, indices=indices)
        outcomes: list[str] = []
        refused = asyncio.Event()

        async def read_replies(sock: AsyncClient) -> None:
            for _ in range(4):
                frames = await asyncio.wait_for(sock.sock.recv_multipart(), REPLY_TIMEOUT_S)
                try:
                    assert isinstance(parse_message(frames, REPLIES)[0], DataReply)
                    outcomes.append("ok")
                except RemoteError as exc:
                    assert exc.code == ErrorCode.BUSY
                    outcomes.append("busy")
                    if outcomes.count("busy") == 9:
                        refused.set()

        for sock in socks:
            for _ in range(4):
                await sock.send(request)
        readers = [asyncio.create_task(read_replies(sock)) for sock in socks]
        try:
            # every refusal comes while the taken requests are still being read
            await asyncio.wait_for(refused.wait(), REPLY_TIMEOUT_S)
        finally:
            release.set()
            await asyncio.gather(*readers)
        assert outcomes.count("ok") == 3


async def test_what_a_worker_says_cannot_forge_a_log_line(
    small_hsi, caplog: pytest.LogCaptureFixture
) -> None:
    async with live_server(small_hsi, mode="async") as ps, clients(ps.address, 1) as (c,):
        member, _ = await c.join("w")
        forged = "bye\nWARNING pserver: worker admin joined"
        with caplog.at_level(logging.INFO, logger="pserver"):
            await c.request(
                LeaveRequest(worker_id=member.worker_id, token=member.token, reason=forged)
            )
            await asyncio.wait_for(ps.roster.emptied.wait(), REPLY_TIMEOUT_S)
        gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
        assert gone == ["worker w is gone: left: bye\\nWARNING pserver: worker admin joined"]
