"""A live server on 127.0.0.1 against scripted clients: hostile input, staleness, replays."""

from __future__ import annotations

import asyncio
import json
import sys

import msgpack
import numpy as np
import pytest
import torch

from common.errors import ErrorCode
from common.protocol.messages import (
    DataReply,
    DataRequest,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
)
from common.protocol.wire import PROTOCOL_VERSION
from tests.live import AsyncClient, clients, live_server


async def _join(client: AsyncClient, name: str, speed: float = 100.0) -> tuple[int, TaskReply]:
    join = await client.request(JoinRequest(name=name, device="cpu", slowdown=1.0, threads=1))
    assert isinstance(join, JoinReply)
    task = await client.request(TaskRequest(worker_id=join.worker_id, speed=speed))
    assert isinstance(task, TaskReply) and task.action == "train"
    return join.worker_id, task


def _push(worker_id: int, task: TaskReply, state: np.ndarray, **changes) -> PushRequest:
    fields = dict(
        worker_id=worker_id,
        task_id=task.task_id,
        version=task.version,
        batch_size=len(task.indices),
        speed=100.0,
        compute_s=0.01,
        loss=1.0,
        state=state,
    )
    fields.update(changes)
    return PushRequest(**fields)


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
        worker_id, task = await _join(client, "honest")
        size = ps.trainer.state_size
        before = ps.trainer.snapshot.state.clone()
        version = ps.trainer.version

        for name, (frames, code) in RAW_ATTACKS.items():
            reply = msgpack.unpackb((await attacker.send_raw(frames))[0])
            assert reply["status"] == "error" and reply["code"] == code, (name, reply)

        good = np.zeros(size, dtype=np.float32)
        nan = good.copy()
        nan[size // 2] = np.nan
        inf = good.copy()
        inf[0] = np.inf
        cases = [
            (_push(worker_id, task, nan), ErrorCode.NON_FINITE),
            (_push(worker_id, task, inf), ErrorCode.NON_FINITE),
            (_push(worker_id, task, good[:-1]), ErrorCode.BAD_TENSOR),
            (_push(worker_id, task, good.astype(np.float64)), ErrorCode.BAD_TENSOR),
            (_push(worker_id, task, good, task_id=task.task_id + 100), ErrorCode.WRONG_TASK),
            (_push(worker_id, task, good, batch_size=len(task.indices) + 1), ErrorCode.BAD_FIELD),
            (_push(worker_id, task, good, version=10**6), ErrorCode.BAD_FIELD),
            (_push(worker_id + 50, task, good), ErrorCode.UNKNOWN_WORKER),
            (DataRequest(worker_id=worker_id, indices=[-1]), ErrorCode.BAD_FIELD),
            (
                DataRequest(worker_id=worker_id, indices=[int(ps.reader.test_indices[0])]),
                ErrorCode.BAD_FIELD,
            ),
            (JoinRequest(name="", device="cpu", slowdown=1.0, threads=1), ErrorCode.BAD_FIELD),
            (TaskRequest(worker_id=worker_id, speed=-1.0), ErrorCode.BAD_FIELD),
        ]
        for message, code in cases:
            error = await attacker.expect_error(message)
            assert error.code == code, (message.TYPE, error)

        assert ps.trainer.version == version
        assert torch.equal(ps.trainer.snapshot.state, before)
        status = await attacker.request(StatusRequest())
        assert isinstance(status, StatusReply) and status.status["version"] == version

        data = await client.request(DataRequest(worker_id=worker_id, indices=task.indices))
        assert isinstance(data, DataReply) and data.x.shape[0] == len(task.indices)
        nxt = await client.request(_push(worker_id, task, good))
        assert isinstance(nxt, TaskReply) and nxt.version == version + 1
        replay = await client.expect_error(_push(worker_id, task, good))
        assert replay.code == ErrorCode.WRONG_TASK
        assert ps.trainer.version == version + 1


async def test_max_staleness_rejects_old_pushes_and_the_worker_re_pulls(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=100, max_staleness=0) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        id_a, task_a = await _join(a, "a")
        id_b, task_b = await _join(b, "b")
        zeros = np.zeros(ps.trainer.state_size, dtype=np.float32)
        await a.request(_push(id_a, task_a, zeros))  # version 0 -> 1
        state = ps.trainer.snapshot.state.clone()
        stale = await b.expect_error(_push(id_b, task_b, zeros))  # computed on 0: tau = 1 > 0
        assert stale.code == ErrorCode.STALE
        assert torch.equal(ps.trainer.snapshot.state, state) and ps.trainer.version == 1
        again = await b.request(TaskRequest(worker_id=id_b, speed=100.0))
        assert isinstance(again, TaskReply)
        assert again.task_id == task_b.task_id and again.version == 1
        assert again.indices == task_b.indices
        fresh = await b.request(_push(id_b, again, zeros))
        assert isinstance(fresh, TaskReply) and ps.trainer.version == 2


async def test_status_command_reports_mode_version_and_workers(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=2) as ps,
        clients(ps.address, 1) as (client,),
    ):
        await client.request(JoinRequest(name="slow-node", device="cpu", slowdown=3.0, threads=1))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pserver.cli",
            "status",
            "--server",
            ps.address,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        status = json.loads(out)
        assert status["mode"] == "weighted-sync" and status["version"] == 0
        assert status["epoch"] == 1 and status["waiting_for"] == 2  # none calibrated yet
        assert [w["name"] for w in status["workers"]] == ["slow-node"]
        assert {"speed", "samples"} <= set(status["workers"][0])
        assert status["workers"][0]["ready"] is False


@pytest.mark.parametrize("mode", ["weighted-sync", "equal-sync"])
async def test_sync_round_waits_for_every_worker_then_replies_to_all(small_hsi, mode) -> None:
    async with (
        live_server(small_hsi, mode=mode, workers=2, global_batch=30) as ps,
        clients(ps.address, 2) as (fast, slow),
    ):
        join_f = await fast.request(JoinRequest(name="f", device="cpu", slowdown=1, threads=1))
        join_s = await slow.request(JoinRequest(name="s", device="cpu", slowdown=1, threads=1))
        tasks = await asyncio.gather(
            fast.request(TaskRequest(worker_id=join_f.worker_id, speed=200.0)),
            slow.request(TaskRequest(worker_id=join_s.worker_id, speed=100.0)),
        )
        sizes = [len(t.indices) for t in tasks]
        assert sum(sizes) == 30
        assert sizes == ([20, 10] if mode == "weighted-sync" else [15, 15])
        zeros = np.zeros(ps.trainer.state_size, dtype=np.float32)
        first = asyncio.create_task(fast.request(_push(join_f.worker_id, tasks[0], zeros)))
        done, _ = await asyncio.wait({first}, timeout=0.5)
        assert not done, "the round closed before the slow worker pushed"
        assert set(ps.policy.rounds[0].received) == {join_f.worker_id}
        assert ps.trainer.version == 0
        second = await slow.request(_push(join_s.worker_id, tasks[1], zeros))
        assert (await first).version == second.version == 1


async def test_a_push_that_arrived_counts_even_if_its_worker_then_leaves(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="weighted-sync", workers=2, global_batch=30) as ps,
        clients(ps.address, 3) as (a, b, a_again),
    ):
        join_a = await a.request(JoinRequest(name="a", device="cpu", slowdown=1, threads=1))
        join_b = await b.request(JoinRequest(name="b", device="cpu", slowdown=1, threads=1))
        task_a, task_b = await asyncio.gather(
            a.request(TaskRequest(worker_id=join_a.worker_id, speed=200.0)),
            b.request(TaskRequest(worker_id=join_b.worker_id, speed=100.0)),
        )
        zeros = np.zeros(ps.trainer.state_size, dtype=np.float32)
        waiting = asyncio.create_task(a.request(_push(join_a.worker_id, task_a, zeros)))
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done and set(ps.policy.rounds[0].received) == {join_a.worker_id}
        await a_again.request(LeaveRequest(worker_id=join_a.worker_id, reason="bye"))
        reply = await b.request(_push(join_b.worker_id, task_b, zeros))
        assert isinstance(reply, TaskReply) and ps.trainer.version == 1
        ledger = ps.trainer.sampler.ledgers[1]
        assert ledger.applied == 30  # a's 20 samples count: its gradient is in the update
        workers = {w.name: w for w in ps.roster.all_workers()}
        assert workers["a"].samples == len(task_a.indices) == 20
        waiting.cancel()
