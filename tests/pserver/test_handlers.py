"""The coordinator's request handlers, one request type at a time, against a live server on
127.0.0.1: what each answers, what each refuses, and what a refusal leaves unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from common.data.dataset import DatasetReader
from common.errors import ErrorCode
from common.protocol.ending import FinishReason
from common.protocol.messages import (
    DataReply,
    DataRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
)
from common.training.perfmodel import MAX_CALIBRATION
from tests.support.cluster import events
from tests.support.live import clients, live_server

QUIET_S = 0.5  # how long a request that must stay unanswered is watched


def join_request(name: str) -> JoinRequest:
    return JoinRequest(name=name, device="cpu", slowdown=1.0, threads=1)


async def test_a_join_is_answered_with_the_run_it_joins(small_hsi: Path) -> None:
    with DatasetReader(small_hsi) as reader:
        meta = reader.meta
    async with (
        live_server(small_hsi, mode="async", wire_dtype="bf16") as ps,
        clients(ps.address, 2) as (a, b),
    ):
        first = await a.request(join_request("a"))
        second = await b.request(join_request("b"))
    assert isinstance(first, JoinReply) and isinstance(second, JoinReply)
    assert first.worker_id != second.worker_id and first.token != second.token
    assert first.server_id == second.server_id
    assert (first.mode, first.model, first.wire_dtype) == ("async", "hsi-cnn", "bf16")
    assert first.dataset_fingerprint == meta.fingerprint
    assert (first.in_channels, first.input_size, first.num_classes) == (
        meta.shape[0],
        meta.shape[1],
        meta.num_classes,
    )
    assert first.shard_addresses == [""]  # one shard: the server holds the parameters
    assert first.shard_bounds == [0, first.state_size]
    assert 0 < first.num_params <= first.state_size


@pytest.mark.parametrize(
    "request_",
    [
        JoinRequest(name="", device="cpu", slowdown=1.0, threads=1),
        JoinRequest(name="w", device="cpu", slowdown=0.5, threads=1),
        JoinRequest(name="w", device="cpu", slowdown=1.0, threads=0),
        JoinRequest(name="w", device="cpu", slowdown=1.0, threads=5000),
        JoinRequest(name="w\nWARNING forged line", device="cpu", slowdown=1.0, threads=1),
        JoinRequest(name="w", device="<img src=x onerror=alert(1)>", slowdown=1.0, threads=1),
        JoinRequest(name="# heading", device="cpu", slowdown=1.0, threads=1),
        JoinRequest(name="w", device="cpu", slowdown=1, threads=1, torch_version="2\r\nx"),
    ],
    ids=[
        "no-name",
        "speed-up",
        "no-threads",
        "too-many-threads",
        "newline",
        "markup",
        "heading",
        "torch-control",
    ],
)
async def test_a_join_out_of_range_is_refused_and_adds_no_member(
    small_hsi: Path, request_: JoinRequest
) -> None:
    async with live_server(small_hsi, mode="async") as ps, clients(ps.address, 1) as (c,):
        error = await c.expect_error(request_)
        assert error.code == ErrorCode.BAD_FIELD
        joined = await c.request(join_request("after"))
        assert isinstance(joined, JoinReply)
        status = await c.request(StatusRequest())
        assert isinstance(status, StatusReply)
        assert [w["name"] for w in status.status["workers"]] == ["after"]


async def test_training_starts_once_the_expected_workers_are_ready(
    small_hsi: Path, tmp_path: Path
) -> None:
    async with (
        live_server(small_hsi, workers=2, run_dir=tmp_path) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        join_a = await a.request(join_request("a"))
        ask_a = await a.send(TaskRequest(worker_id=join_a.worker_id, token=join_a.token, speed=9))
        reply_a = asyncio.ensure_future(a.receive(ask_a))
        done, _ = await asyncio.wait({reply_a}, timeout=QUIET_S)
        assert not done  # one of two workers: no task yet
        join_b = await b.request(join_request("b"))
        task_b = await b.request(
            TaskRequest(worker_id=join_b.worker_id, token=join_b.token, speed=3)
        )
        task_a = await asyncio.wait_for(reply_a, 30)
    assert isinstance(task_a, TaskReply) and isinstance(task_b, TaskReply)
    assert task_a.action == task_b.action == "train"
    assert not set(task_a.indices) & set(task_b.indices)
    assert len(task_a.indices) + len(task_b.indices) == 64  # the global batch
    assert len(task_a.indices) > len(task_b.indices)  # the faster worker gets more
    starts = [e for e in events(tmp_path) if e["event"] == "train_start"]
    assert [(e["workers"], e["version"]) for e in starts] == [(2, 0)]


@pytest.mark.parametrize(
    ("batches", "seconds"),
    [
        ([8, 16], [0.1]),
        ([8], None),
        (None, [0.1]),
        ([8] * (MAX_CALIBRATION + 1), [0.1] * (MAX_CALIBRATION + 1)),
    ],
    ids=["unpaired", "no-seconds", "no-batches", "too-many"],
)
async def test_task_requests_with_bad_calibration_are_refused(
    small_hsi: Path, batches: list[int] | None, seconds: list[float] | None
) -> None:
    async with live_server(small_hsi, mode="async") as ps, clients(ps.address, 1) as (c,):
        join = await c.request(join_request("w"))
        bad = TaskRequest(
            worker_id=join.worker_id,
            token=join.token,
            speed=10.0,
            calibration_batches=batches,
            calibration_s=seconds,
        )
        assert (await c.expect_error(bad)).code == ErrorCode.BAD_FIELD
        good = TaskRequest(
            worker_id=join.worker_id,
            token=join.token,
            speed=10.0,
            calibration_batches=[8, 16],
            calibration_s=[0.1, 0.2],
        )
        task = await c.request(good)
        assert isinstance(task, TaskReply) and task.action == "train"


async def test_data_requests_serve_training_samples_only_and_within_the_cap(
    small_hsi: Path,
) -> None:
    with DatasetReader(small_hsi) as reader:
        train_five = [int(i) for i in reader.train_indices[:5]]
        expected_x, expected_y = reader.read_stored(np.asarray(train_five))
        test_index = int(reader.test_indices[0])
        first_train = int(reader.train_indices[0])
    async with live_server(small_hsi, mode="async") as ps, clients(ps.address, 1) as (c,):
        member, _ = await c.join("w")
        ask = dict(worker_id=member.worker_id, token=member.token)
        data = await c.request(DataRequest(**ask, indices=train_five))
        assert isinstance(data, DataReply)
        assert np.array_equal(data.x, expected_x) and np.array_equal(data.y, expected_y)
        refused = await c.expect_error(DataRequest(**ask, indices=[first_train, test_index]))
        assert refused.code == ErrorCode.BAD_FIELD and "training split" in str(refused)
        huge = await c.expect_error(DataRequest(**ask, indices=[first_train] * 100_000))
        assert huge.code == ErrorCode.BAD_FIELD and "MiB" in str(huge)


async def test_heartbeats_and_leaves_need_the_members_token(small_hsi: Path) -> None:
    async with live_server(small_hsi, mode="async") as ps, clients(ps.address, 2) as (a, b):
        member_a, _ = await a.join("a")
        member_b, _ = await b.join("b")
        beat = await a.request(HeartbeatRequest(worker_id=member_a.worker_id, token=member_a.token))
        assert isinstance(beat, HeartbeatReply)
        assert (beat.server_id, beat.finish_reason, beat.failure) == (
            member_a.join.server_id,
            None,
            None,
        )
        forged = LeaveRequest(worker_id=member_a.worker_id, token=member_b.token, reason="x")
        assert (await b.expect_error(forged)).code == ErrorCode.UNKNOWN_WORKER
        left = await a.request(
            LeaveRequest(worker_id=member_a.worker_id, token=member_a.token, reason="done")
        )
        assert isinstance(left, LeaveReply)
        gone = HeartbeatRequest(worker_id=member_a.worker_id, token=member_a.token)
        assert (await a.expect_error(gone)).code == ErrorCode.UNKNOWN_WORKER
        still = await b.request(
            HeartbeatRequest(worker_id=member_b.worker_id, token=member_b.token)
        )
        assert isinstance(still, HeartbeatReply) and still.finish_reason is None


async def test_after_the_last_step_heartbeats_say_finished_and_joins_are_refused(
    small_hsi: Path,
) -> None:
    async with (
        live_server(small_hsi, mode="async", max_steps=1) as ps,
        clients(ps.address, 3) as (a, idle, late),
    ):
        member, task = await a.join("a")
        idler = await idle.request(join_request("idle"))  # joined, never asks for a task
        reply = await a.push(member, task, np.zeros(ps.state_size, dtype=np.float32))
        assert isinstance(reply, TaskReply) and reply.action == "stop" and reply.version == 1
        assert reply.finish_reason is FinishReason.MAX_STEPS
        beat = await idle.request(HeartbeatRequest(worker_id=idler.worker_id, token=idler.token))
        assert isinstance(beat, HeartbeatReply) and beat.failure is None
        assert beat.finish_reason is FinishReason.MAX_STEPS
        # ``a`` left the roster with its stop reply; a heartbeat sent before it read that reply
        # learns that training ended (not that it is unknown), and only with its own token.
        stopped = await a.request(HeartbeatRequest(worker_id=member.worker_id, token=member.token))
        assert isinstance(stopped, HeartbeatReply) and stopped.finish_reason is not None
        forged = HeartbeatRequest(worker_id=member.worker_id, token=idler.token)
        assert (await a.expect_error(forged)).code == ErrorCode.UNKNOWN_WORKER
        refused = await late.expect_error(join_request("late"))
        assert refused.code == ErrorCode.SHUTTING_DOWN
