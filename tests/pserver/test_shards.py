"""Parameter shards: the same scripted pushes give the same state bit for bit with 1, 2 or 3
shards (two-phase publish, sums in worker order); shards refuse hostile input unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from common.errors import ConfigError, ErrorCode, ProtocolError, RemoteError
from common.protocol.chunks import chunk_spans
from common.protocol.messages import (
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    PullRequest,
    TaskReply,
    TaskRequest,
)
from common.protocol.security import hello_proof, write_shard_secret
from common.protocol.shard_messages import (
    AbortRequest,
    CaptureRequest,
    PingReply,
    PingRequest,
    PrepareRequest,
    PublishRequest,
    ShardHello,
)
from common.protocol.wire import PROTOCOL_VERSION, encode_frames
from pserver.config import ShardConfig
from pserver.store.shard_server import ShardServer
from pserver.store.stores import RemoteStores
from tests.support.live import (
    AsyncClient,
    Member,
    clients,
    gradient_chunk,
    live_server,
    live_sharded,
    poll_until_async,
    push_request,
)

ROUNDS = 5
# The speed planner: the model planner follows measured round times, which no script repeats.
SETTINGS = dict(
    global_batch=30, chunk_mb=0.02, epochs=50, momentum=0.9, weight_decay=1e-4, planner="speed"
)


def _gradient(task: TaskReply, size: int, num_params: int) -> np.ndarray:
    """A deterministic gradient per task: parameters noisy, buffer changes small and positive
    (so running variances stay valid)."""
    rng = np.random.default_rng(sum(task.indices) + 7919 * task.epoch)
    values = rng.normal(0.0, 0.05, size).astype(np.float32)
    values[num_params:] = np.abs(values[num_params:]) * 0.01
    return values


async def _members(a: AsyncClient, b: AsyncClient) -> list[tuple[Member, TaskReply, AsyncClient]]:
    """Join a then b (fixed worker ids), then wait for both first tasks."""
    joins = []
    for client, name in ((a, "a"), (b, "b")):
        join = await client.request(JoinRequest(name=name, device="cpu", slowdown=1, threads=1))
        assert isinstance(join, JoinReply)
        joins.append(Member(join))
    tasks = await asyncio.gather(
        *(
            c.request(TaskRequest(worker_id=m.worker_id, token=m.token, speed=s))
            for c, m, s in ((a, joins[0], 200.0), (b, joins[1], 100.0))
        )
    )
    return [(m, t, c) for m, t, c in zip(joins, tasks, (a, b), strict=True)]  # type: ignore[misc]


async def _script(ps, mode: str) -> tuple[torch.Tensor, np.ndarray]:
    size, num_params = ps.state_size, ps.num_params
    async with clients(ps.address, 2) as (a, b):
        workers = await _members(a, b)
        for _ in range(ROUNDS):
            if mode == "async":  # one after the other: the same staleness every run
                for i, (member, task, client) in enumerate(workers):
                    reply = await client.push(member, task, _gradient(task, size, num_params))
                    assert isinstance(reply, TaskReply) and reply.action == "train"
                    workers[i] = (member, reply, client)
            else:
                replies = await asyncio.gather(
                    *(c.push(m, t, _gradient(t, size, num_params)) for m, t, c in workers)
                )
                workers = [(m, r, c) for (m, _, c), r in zip(workers, replies, strict=True)]
        captured = await ps.stores.capture(with_slots=True)
        assert ps.updater.version == (2 * ROUNDS if mode == "async" else ROUNDS)
    return torch.from_numpy(captured.state.copy()), captured.slot_state.copy()


@pytest.mark.parametrize(
    ("mode", "shards", "wire"),
    [
        ("weighted-sync", 2, "fp32"),
        ("weighted-sync", 3, "fp32"),
        ("weighted-sync", 2, "bf16"),
        ("async", 2, "fp32"),
    ],
)
async def test_sharded_updates_equal_unsharded_bit_for_bit(small_hsi, mode, shards, wire) -> None:
    options = dict(SETTINGS, mode=mode, workers=2, wire_dtype=wire)
    async with live_server(small_hsi, **options) as single:
        state_1, slots_1 = await _script(single, mode)
    async with live_sharded(small_hsi, shards, **options) as sharded:
        assert isinstance(sharded.stores, RemoteStores)
        state_k, slots_k = await _script(sharded, mode)
    assert torch.equal(state_k, state_1)
    assert np.array_equal(slots_k, slots_1)
    assert not torch.equal(state_1, torch.from_numpy(single.initial.state))  # it did train


async def test_a_shard_refuses_hostile_input_and_keeps_its_slice(small_hsi) -> None:
    async with live_sharded(small_hsi, 2, **dict(SETTINGS, mode="async")) as ps:
        link = ps.stores.links[0]
        async with clients(ps.address, 1) as (honest,):
            member, task = await honest.join("honest")
        before = await ps.stores.capture(with_slots=True)
        async with clients(link.address, 1) as (attacker,):
            for frames in (
                [b"\x00garbage"],
                [
                    msgpack.packb(
                        {"v": PROTOCOL_VERSION, "type": "prepare_request", "id": 3, "body": {}}
                    )
                ],
            ):
                reply = msgpack.unpackb((await attacker.send_raw(frames))[0])
                assert reply["status"] == "error"
            forged = [
                PrepareRequest(
                    key="x" * 64,
                    version=1,
                    task_ids=[task.task_id],
                    weights=[1.0],
                    lr_scale=1e9,
                    buffer_scale=1.0,
                ),
                PublishRequest(key="", version=1),
                AbortRequest(key="", version=1, code=13, message="x"),
                CaptureRequest(key="guess", with_slots=True),
                CaptureRequest(key="é" * 64, with_slots=True),  # not ASCII: compared safely
                PullRequest(
                    worker_id=member.worker_id, token="0" * 32, min_version=0, offset=0, length=7
                ),
            ]
            for message in forged:
                error = await attacker.expect_error(message)
                assert error.code in (ErrorCode.UNKNOWN_WORKER, ErrorCode.BAD_FIELD), error
            wrong_token = await attacker.send_gradient(
                member, task, np.zeros(ps.state_size, np.float32), token="f" * 32
            )
            store, rid = wrong_token[0]
            with pytest.raises(RemoteError) as refused:
                await store.receive(rid)
            assert refused.value.code == ErrorCode.WRONG_TASK
        after = await ps.stores.capture(with_slots=True)
        assert after.version == before.version == 0
        assert np.array_equal(after.state, before.state)


# --- who may register as a shard, and what a shard may hand back ------------------------------


@contextlib.asynccontextmanager
async def _shards(ps, count: int, **options: Any) -> AsyncIterator[list[ShardServer]]:
    """``count`` shard servers registered with ``ps`` on this event loop."""
    servers = [
        ShardServer(ShardConfig(coordinator=ps.address, bind="tcp://127.0.0.1:0", **options))
        for _ in range(count)
    ]
    running = [asyncio.create_task(s.run()) for s in servers]
    try:
        await asyncio.wait_for(ps.stores.ready.wait(), 30)
        # The coordinator is ready once it has registered every hello; a shard serves once its
        # welcome reply has arrived, which may be a moment later.
        await poll_until_async(
            lambda: all(s.service is not None for s in servers), 30, what="shard services"
        )
        yield servers
    finally:
        for server in servers:
            server.request_stop()
        await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 30)
        for server in servers:
            await server.close()


async def test_a_shard_hello_without_the_secret_is_refused_and_changes_nothing(
    small_hsi, tmp_path
) -> None:
    secret = write_shard_secret(tmp_path / "shard.secret")
    other = write_shard_secret(tmp_path / "other.secret").read_bytes()
    options = dict(SETTINGS, mode="async", shards=2, shard_secret_file=secret)
    async with live_server(small_hsi, **options) as ps, clients(ps.address, 1) as (caller,):
        address = "tcp://127.0.0.1:5999"
        body = {"address": address, "name": "mallory"}  # a hello that proves nothing
        frames = encode_frames({"type": "shard_hello", "id": 1, "status": "ok", "body": body}, [])
        assert msgpack.unpackb((await caller.send_raw(frames))[0])["status"] == "error"
        for proof in (
            "",
            "0" * 64,
            hello_proof(other, address, "mallory"),  # another secret
            hello_proof(secret.read_bytes(), "tcp://127.0.0.1:6000", "mallory"),  # replayed
        ):
            hello = ShardHello(address=address, name="mallory", proof=proof)
            assert (await caller.expect_error(hello)).code == ErrorCode.UNAUTHORIZED
        assert ps.stores.links == [] and not ps.stores.ready.is_set()
        async with _shards(ps, 2, secret_file=secret) as servers:
            assert [link.index for link in ps.stores.links] == [0, 1]  # no range was taken
            member, _ = await caller.join("honest")
            shard_book = servers[0].service.tokens
            assert shard_book.key != ps.tokens.key  # shards never get the token key
            forged = HeartbeatRequest(
                worker_id=member.worker_id, token=shard_book.token(member.worker_id)
            )
            assert (await caller.expect_error(forged)).code == ErrorCode.UNKNOWN_WORKER
            await caller.request(HeartbeatRequest(worker_id=member.worker_id, token=member.token))


HOSTILE_STATES = [
    (lambda state, rows: (state.astype(np.float64), rows), ErrorCode.BAD_TENSOR),
    (lambda state, rows: (state[:-1], rows), ErrorCode.BAD_TENSOR),
    (lambda state, rows: (state, rows[:-1]), ErrorCode.BAD_TENSOR),
    (lambda state, rows: (np.full_like(state, np.nan), rows), ErrorCode.NON_FINITE),
    (lambda state, rows: (state, np.full_like(rows, np.inf)), ErrorCode.NON_FINITE),
]


async def test_a_state_a_shard_hands_back_is_checked_before_a_checkpoint(
    small_hsi, tmp_path
) -> None:
    secret = write_shard_secret(tmp_path / "shard.secret")
    run_dir = tmp_path / "run"
    options = dict(SETTINGS, mode="async", shards=2, shard_secret_file=secret, run_dir=run_dir)
    async with (
        live_server(small_hsi, **options) as ps,
        _shards(ps, 2, secret_file=secret) as servers,
    ):
        assert await ps.checkpointer.save()  # an honest capture is written
        written = sorted((run_dir / "checkpoints").glob("ckpt-*.npz"))
        service = servers[1].service
        honest = service.capture
        for change, code in HOSTILE_STATES:

            async def hostile(with_slots: bool, change=change):
                captured = await honest(with_slots)
                state, rows = change(captured.state, captured.slot_state.reshape(-1))
                return dataclasses.replace(captured, state=state, slot_state=rows)

            service.capture = hostile  # type: ignore[method-assign]
            with pytest.raises(ProtocolError) as refused:
                await ps.stores.capture(with_slots=True)
            assert refused.value.code == code
            assert f"shard {servers[1].index} at" in str(refused.value)
            assert not await ps.checkpointer.save()
        assert sorted((run_dir / "checkpoints").glob("ckpt-*.npz")) == written


def test_shards_need_a_secret_of_their_own(small_hsi, tmp_path) -> None:
    from common.errors import ConfigError
    from common.protocol.security import shard_secret
    from pserver.config import ServerConfig

    with pytest.raises(ConfigError, match="--shard-secret-file"):
        ServerConfig(dataset=small_hsi, model="hsi-cnn", shards=2, epochs=1)
    with pytest.raises(ConfigError, match="--secret-file"):
        ShardConfig(coordinator="tcp://127.0.0.1:5555")
    short = tmp_path / "short.secret"
    short.write_bytes(b"0123456789")
    with pytest.raises(ConfigError, match="fewer than 16 bytes"):
        shard_secret(short, None)
    secret = write_shard_secret(tmp_path / "shard.secret")
    assert secret.stat().st_mode & 0o077 == 0 and len(shard_secret(secret, None)) == 32
    with pytest.raises(FileExistsError):
        write_shard_secret(secret)  # never over (or through) what is already there


@pytest.mark.parametrize("option", ["coordinator", "bind", "advertise"])
def test_a_shard_refuses_an_endpoint_without_a_scheme(option: str) -> None:
    given = {"coordinator": "tcp://127.0.0.1:5555", option: "host:5555"}
    with pytest.raises(ConfigError, match=f"--{option} 'host:5555' must look like tcp://"):
        ShardConfig(**given)


async def test_a_round_one_shard_refuses_is_dropped_and_answered_in_every_shard(small_hsi) -> None:
    """The shard that holds the running variances finds the round's update invalid while the
    other has a valid candidate: every shard drops the round's gradients and answers each of
    their chunks once, and the workers' next round is published."""
    options = dict(SETTINGS, mode="weighted-sync", workers=2, epochs=3)
    async with live_sharded(small_hsi, 2, **options) as ps, clients(ps.address, 2) as (a, b):
        size, num_params = ps.state_size, ps.num_params
        (member_a, task_a, _), (member_b, task_b, _) = await _members(a, b)
        bad = _gradient(task_a, size, num_params)
        bad[ps.nonneg[0] : ps.nonneg[1]] = -1e3  # the running variances would go negative
        sent = [
            *(await a.send_gradient(member_a, task_a, bad)),
            *(await b.send_gradient(member_b, task_b, _gradient(task_b, size, num_params))),
        ]
        pushes = [
            (a, await a.send(push_request(member_a, task_a))),
            (b, await b.send(push_request(member_b, task_b))),
        ]
        for client, rid in [*sent, *pushes]:
            with pytest.raises(RemoteError) as refused:
                await client.receive(rid)
            assert refused.value.code == ErrorCode.REFUSED
        assert ps.updater.version == 0
        for link in ps.stores.links:
            assert (
                await link.connection.request(PingRequest(key=ps.stores.key), 5.0, PingReply)
            ).staged == 0
        tasks = await asyncio.gather(
            *(
                c.request(TaskRequest(worker_id=m.worker_id, token=m.token, speed=100.0))
                for c, m in ((a, member_a), (b, member_b))
            )
        )
        replies = await asyncio.gather(
            *(
                c.push(m, t, _gradient(t, size, num_params))
                for c, m, t in zip((a, b), (member_a, member_b), tasks, strict=True)
            )
        )
        assert all(isinstance(r, TaskReply) and r.action == "train" for r in replies)
        assert ps.updater.version == 1


async def test_a_push_that_finds_a_shard_lost_fails_the_run_and_stops_its_worker(
    small_hsi, tmp_path
) -> None:
    """A shard stops answering while a push waits for its gradient: the run fails at once
    (as when an update finds it lost), and the pushing worker is told to stop, naming why."""
    secret = write_shard_secret(tmp_path / "shard.secret")
    # the shard watch pings only after the push has found the shard lost
    timeouts = dict(shard_timeout_s=1.0, stage_timeout_s=1.0, heartbeat_s=60.0, dead_after_s=120.0)
    options = dict(SETTINGS, mode="async", shards=2, shard_secret_file=secret, **timeouts)
    async with (
        live_server(small_hsi, **options) as ps,
        _shards(ps, 2, secret_file=secret) as servers,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("w")
        lost = next(s for s in servers if s.index == 1)
        lost.request_stop()  # it no longer answers
        await client.send_gradient(member, task, np.full(ps.state_size, 1e-4, np.float32))
        reply = await client.request(push_request(member, task))
        assert isinstance(reply, TaskReply) and reply.action == "stop"
        assert reply.failure and "shard 1" in reply.failure
        assert ps.run.failed and ps.run.stores_lost


async def test_chunks_that_reach_a_shard_after_their_push_was_incomplete_are_not_kept(
    small_hsi, tmp_path
) -> None:
    """None of a push's chunks reached one shard in time (its link is slow): the push is
    refused as INCOMPLETE, and when those chunks come they are answered at once and not kept,
    so the worker's next push of the task is staged whole on every shard and applied."""
    secret = write_shard_secret(tmp_path / "shard.secret")
    options = dict(SETTINGS, mode="async", shards=2, shard_secret_file=secret, stage_timeout_s=0.5)
    async with (
        live_server(small_hsi, **options) as ps,
        _shards(ps, 2, secret_file=secret) as servers,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("w")
        gradient = np.full(ps.state_size, 1e-4, np.float32)
        join = member.join
        fast, slow = (client.store(address) for address in join.shard_addresses)
        lo, hi = join.shard_bounds[1], join.shard_bounds[2]
        sent = [
            await fast.send(gradient_chunk(member, task, a, gradient[a:b]))
            for a, b in chunk_spans(join.shard_bounds[0], lo, join.chunk_elems)
        ]
        with pytest.raises(RemoteError) as incomplete:
            await client.request(push_request(member, task))
        assert incomplete.value.code == ErrorCode.INCOMPLETE
        for rid in sent:
            with pytest.raises(RemoteError) as answered:
                await fast.receive(rid)
            assert answered.value.code == ErrorCode.INCOMPLETE
        for a, b in chunk_spans(lo, hi, join.chunk_elems):  # they come now
            with pytest.raises(RemoteError) as answered:
                await slow.request(gradient_chunk(member, task, a, gradient[a:b]))
            assert answered.value.code == ErrorCode.INCOMPLETE
        assert all(not server.service.store.staged for server in servers)
        again = await client.request(
            TaskRequest(worker_id=member.worker_id, token=member.token, speed=100.0)
        )
        assert isinstance(again, TaskReply) and again.task_id == task.task_id
        reply = await client.push(member, again, gradient)
        assert isinstance(reply, TaskReply) and reply.action == "train"
        assert ps.updater.version == 1
