"""A push that carries its gradient and a reply that carries the parameters: one message each
way per round when the coordinator is the only store and the state is one chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import ErrorCode
from common.protocol.chunks import as_tensor, decode_into
from common.protocol.messages import TaskParamsReply, TaskReply
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
