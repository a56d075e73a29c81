"""A push that carries its gradient and a reply that carries the parameters: one message each
way per round when the coordinator is the only store and the state is one chunk."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from common.errors import ErrorCode, RemoteError
from common.protocol.chunks import as_tensor, decode_into, encode
from common.protocol.messages import TaskParamsReply, TaskReply
from pserver.updates import GUARD_WARMUP, STRIKES_BEFORE_DROP
from tests.support.live import clients, gradient_push, live_server, live_sharded, published


def _gradient(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1e-3, size).astype(np.float32)


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
async def test_a_push_with_its_gradient_updates_as_chunks_do_and_returns_the_parameters(
    small_hsi, wire: str
) -> None:
    """The same gradient pushed both ways gives the same state bit for bit; the fused reply
    carries exactly the published parameters."""
    states = []
    for fused in (False, True):
        async with (
            live_server(small_hsi, mode="async", seed=3, wire_dtype=wire, epochs=5) as ps,
            clients(ps.address, 1) as (client,),
        ):  # fmt: skip
            member, task = await client.join("w")
            gradient = _gradient(ps.state_size)
            if fused:
                reply = await client.request(gradient_push(member, task, gradient))
                assert isinstance(reply, TaskParamsReply) and reply.action == "train"
                assert reply.params_version == reply.version == 1
                got = torch.empty(ps.state_size)
                decode_into(as_tensor(reply.params, wire, "params"), reply.scale, got)
                state = published(ps)
                assert torch.equal(got, state if wire == "fp32" else state.bfloat16().float())
            else:
                reply = await client.push(member, task, gradient)
                assert type(reply) is TaskReply and reply.version == 1
            states.append(published(ps))
    assert torch.equal(states[0], states[1])


async def test_refused_gradient_pushes_change_nothing_and_a_good_one_follows(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=5) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("w")
        before = published(ps)
        good = _gradient(ps.state_size)
        nan = good.copy()
        nan[5] = np.nan
        cases = [
            (gradient_push(member, task, nan), ErrorCode.NON_FINITE),
            (gradient_push(member, task, good, push_token="0" * 32), ErrorCode.WRONG_TASK),
            (gradient_push(member, task, good[:-1]), ErrorCode.BAD_TENSOR),
            (gradient_push(member, task, good, scale=3.0), ErrorCode.BAD_FIELD),
            (gradient_push(member, task, good, batch_size=999), ErrorCode.BAD_FIELD),
            (gradient_push(member, task, good, token="f" * 32), ErrorCode.UNKNOWN_WORKER),
        ]
        for message, code in cases:
            refused = await client.expect_error(message)
            assert refused.code == code, (message, refused)
            assert torch.equal(published(ps), before) and ps.updater.version == 0
        # nothing of the refused pushes stays staged: the same task is taken now
        reply = await client.request(gradient_push(member, task, good))
        assert isinstance(reply, TaskParamsReply) and ps.updater.version == 1


async def test_a_state_of_several_chunks_refuses_a_gradient_inside_the_push(small_hsi) -> None:
    async with (
        live_server(small_hsi, mode="async", chunk_mb=0.01) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("w")
        refused = await client.expect_error(gradient_push(member, task, _gradient(ps.state_size)))
        assert refused.code == ErrorCode.BAD_FIELD and "chunks" in str(refused)
        reply = await client.push(member, task, _gradient(ps.state_size))  # chunk by chunk
        assert type(reply) is TaskReply and ps.updater.version == 1


async def test_a_sharded_run_refuses_a_gradient_inside_the_push(small_hsi) -> None:
    async with live_sharded(small_hsi, 2, mode="async") as ps, clients(ps.address, 1) as (c,):
        member, task = await c.join("w")
        refused = await c.expect_error(gradient_push(member, task, _gradient(ps.state_size)))
        assert refused.code == ErrorCode.BAD_FIELD and "shards" in str(refused)
        reply = await c.push(member, task, _gradient(ps.state_size))  # chunks to each shard
        assert type(reply) is TaskReply and reply.action == "train"


@pytest.mark.parametrize(
    ("wire", "exponents"), [("fp32", (-100, 1)), ("bf16", (-100, 1)), ("fp16", (-100, 600, -600))]
)
async def test_a_scale_the_wire_format_does_not_send_is_refused_before_staging(
    small_hsi, wire: str, exponents: tuple[int, ...]
) -> None:
    """A gradient sent as g * 2^-100 with scale 2^-100 would square to zeros and pass the
    guard at full size; 2^±600 breaks the norm's arithmetic. Each is refused before anything
    is staged, fused or in chunks, and the same task's honest push is then taken."""
    async with (
        live_server(small_hsi, mode="async", wire_dtype=wire, epochs=5) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("w")
        good = _gradient(ps.state_size)
        for exponent in exponents:
            data, scale = encode(torch.from_numpy(good * 1e5), wire)
            bad = {"gradient": data, "scale": scale * 2.0**exponent}
            if wire != "fp16":  # the values as they would be sent: scaled down by 2^-100
                bad["gradient"] = encode(torch.from_numpy(good * 1e5 * bad["scale"]), wire)[0]
            refused = await client.expect_error(replace(gradient_push(member, task, good), **bad))
            assert refused.code == ErrorCode.BAD_FIELD and "scale" in str(refused)
            (store, rid), *_ = await client.send_gradient(member, task, good, **bad)
            with pytest.raises(RemoteError) as chunk_refused:
                await store.receive(rid)
            assert chunk_refused.value.code == ErrorCode.BAD_FIELD
            assert not ps.stores.store.staged and ps.updater.version == 0
        before = published(ps)
        reply = await client.request(gradient_push(member, task, good))
        assert isinstance(reply, TaskParamsReply) and ps.updater.version == 1
        assert float((published(ps) - before).norm()) < 1.0


async def test_a_worker_whose_pushes_are_refused_again_and_again_is_dropped(small_hsi) -> None:
    """Entries of 1e20 are finite but square to Inf in float32: refused as NON_FINITE every
    time (never taken clipped, never counted), and after 10 in a row the worker is dropped."""
    async with (
        live_server(small_hsi, mode="async", epochs=50) as ps,
        clients(ps.address, 1) as (client,),
    ):  # fmt: skip
        member, task = await client.join("w")
        for seed in range(GUARD_WARMUP):
            task = await client.request(gradient_push(member, task, _gradient(ps.state_size, seed)))
            assert isinstance(task, TaskParamsReply)
        huge = np.full(ps.state_size, 1e20, dtype=np.float32)
        for attempt in range(1, STRIKES_BEFORE_DROP + 1):
            refused = await client.expect_error(gradient_push(member, task, huge))
            assert refused.code == ErrorCode.NON_FINITE
            assert ("dropped" in str(refused)) == (attempt == STRIKES_BEFORE_DROP)
        assert ps.updater.version == GUARD_WARMUP and ps.guard.clipped == 0
        gone = await client.expect_error(gradient_push(member, task, _gradient(ps.state_size)))
        assert gone.code == ErrorCode.UNKNOWN_WORKER
