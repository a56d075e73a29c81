"""How applied updates are booked, seen from a live server's run files: a ``push`` event per
async update with its staleness, one ``round`` event per synchronous update naming every
worker, an ``epoch`` event once every training sample was applied exactly once, and the end
of training at ``--epochs`` or ``--max-steps``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from common.data.dataset import DatasetReader
from common.protocol.messages import TaskReply
from tests.support.cluster import events, summary
from tests.support.live import clients, live_server

MAX_PUSHES = 1000  # bounds the loops below; an epoch of the small dataset takes a few


def of_kind(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == kind]


async def test_async_pushes_are_booked_with_their_staleness(
    small_hsi: Path, tmp_path: Path
) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=100, run_dir=tmp_path) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        member_a, task_a = await a.join("a")
        member_b, task_b = await b.join("b")
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        await a.push(member_a, task_a, zeros)  # computed on version 0, applied as 1
        await b.push(member_b, task_b, zeros)  # computed on version 0, applied as 2
    pushes = [
        (e["worker"], e["batch"], e["staleness"], e["version"]) for e in of_kind(tmp_path, "push")
    ]
    assert pushes == [("a", len(task_a.indices), 0, 1), ("b", len(task_b.indices), 1, 2)]
    assert [e["compute_s"] for e in of_kind(tmp_path, "push")] == [0.01, 0.01]  # as reported
    assert of_kind(tmp_path, "round") == []
    assert summary(tmp_path)["staleness"] == {"mean": 0.5, "max": 1}


async def test_a_sync_round_is_booked_once_with_every_worker(
    small_hsi: Path, tmp_path: Path
) -> None:
    async with (
        live_server(small_hsi, workers=2, epochs=100, run_dir=tmp_path) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        replies = await asyncio.gather(
            a.push(member_a, task_a, zeros), b.push(member_b, task_b, zeros)
        )
    assert all(isinstance(r, TaskReply) and r.version == 1 for r in replies)
    (booked,) = of_kind(tmp_path, "round")
    assert booked["version"] == 1 and booked["weight"] == 1.0
    batches = {w["worker"]: w["batch"] for w in booked["workers"]}
    assert batches == {"a": len(task_a.indices), "b": len(task_b.indices)}
    assert sum(batches.values()) == 64  # the global batch
    assert of_kind(tmp_path, "push") == []


async def test_an_epoch_is_booked_when_every_sample_was_applied_once(
    small_hsi: Path, tmp_path: Path
) -> None:
    with DatasetReader(small_hsi) as reader:
        train = len(reader.train_indices)
    applied: list[int] = []
    async with (
        live_server(small_hsi, mode="async", epochs=1, run_dir=tmp_path) as ps,
        clients(ps.address, 1) as (c,),
    ):
        member, task = await c.join("w")
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        for _ in range(MAX_PUSHES):
            applied.extend(task.indices)
            reply = await c.push(member, task, zeros)
            assert isinstance(reply, TaskReply)
            if reply.action == "stop":
                break
            task = reply
    assert sorted(applied) == sorted(set(applied)) and len(applied) == train
    (epoch,) = of_kind(tmp_path, "epoch")
    assert (epoch["epoch"], epoch["samples"], epoch["exactly_once"]) == (1, train, True)
    (finish,) = of_kind(tmp_path, "finish")
    assert finish["reason"] == "epochs" and finish["version"] == epoch["version"]
    result = summary(tmp_path)
    assert (result["epochs"], result["samples_seen"]) == (1, train)
    assert result["steps"] == len(of_kind(tmp_path, "push")) == epoch["version"]


async def test_max_steps_ends_training_at_that_version(small_hsi: Path, tmp_path: Path) -> None:
    async with (
        live_server(small_hsi, mode="async", epochs=100, max_steps=3, run_dir=tmp_path) as ps,
        clients(ps.address, 1) as (c,),
    ):
        member, task = await c.join("w")
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        actions = []
        for _ in range(3):
            reply = await c.push(member, task, zeros)
            assert isinstance(reply, TaskReply)
            actions.append((reply.action, reply.version))
            task = reply
    assert actions == [("train", 1), ("train", 2), ("stop", 3)]
    assert [(e["reason"], e["version"]) for e in of_kind(tmp_path, "finish")] == [("max_steps", 3)]
    assert summary(tmp_path)["finish_reason"] == "max_steps"
