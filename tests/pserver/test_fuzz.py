"""10,000 random and mutated messages against a live, training server: every one gets an error
reply (or a harmless answer), the server keeps serving, and the parameters stay bit-identical."""

from __future__ import annotations

import asyncio
import random

import msgpack
import numpy as np
import torch

from common.protocol.messages import (
    DataRequest,
    GradientChunk,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    PullRequest,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
)
from common.protocol.wire import PROTOCOL_VERSION
from tests.support.live import Member, clients, live_server, published, push_request

MESSAGES = 10_000
BATCH = 200
STRANGER = 10_000  # worker id that is never a member: no fuzzed push can be valid


def _templates(state_size: int) -> list[list[bytes]]:
    grad = np.zeros(min(state_size, 4096), dtype=np.float32)
    token = "0" * 32
    messages = [
        TaskRequest(worker_id=STRANGER, token=token, speed=10.0),
        PushRequest(
            worker_id=STRANGER,
            token=token,
            task_id=1,
            version=0,
            batch_size=4,
            speed=1.0,
            compute_s=0.1,
            transfer_s=0.0,
            loss=0.5,
        ),
        GradientChunk(
            worker_id=STRANGER,
            token=token,
            task_id=1,
            version=0,
            offset=0,
            scale=1.0,
            gradient=grad,
        ),
        PullRequest(worker_id=STRANGER, token=token, min_version=0, offset=0, length=4096),
        DataRequest(worker_id=STRANGER, token=token, indices=[0, 1, 2]),
        HeartbeatRequest(worker_id=STRANGER, token=token),
        LeaveRequest(worker_id=STRANGER, token=token, reason="x"),
        StatusRequest(),
        JoinRequest(name="fuzz", device="cpu", slowdown=0.5, threads=1),  # invalid slowdown
    ]
    return [[bytes(f) for f in m.to_wire(7)] for m in messages]


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == 1:
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), 1e308])
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.randbytes(rng.randrange(8))
    if kind == 5:
        return rng.choice(
            [
                "status_request",
                "push_request",
                "gradient_chunk",
                "pull_request",
                "join_request",
                "task_request",
                "data_request",
                "float32",
                "object",
                "<f4",
            ]
        )
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {
        str(_random_value(rng, depth + 1))[:8]: _random_value(rng, depth + 1)
        for _ in range(rng.randrange(5))
    }


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    i = rng.randrange(len(frames))
    data = bytearray(frames[i])
    choice = rng.randrange(6)
    if choice == 0 and data:  # flip bits
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif choice == 1:  # truncate
        del data[rng.randrange(len(data) + 1) :]
    elif choice == 2:  # insert garbage
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.randbytes(rng.randrange(1, 9))
    elif choice == 3:  # drop or add a frame
        if len(frames) > 1 and rng.random() < 0.5:
            frames.pop()
        else:
            frames.append(rng.randbytes(rng.randrange(64)))
        return frames
    elif choice == 4:  # rewrite a header field
        header = msgpack.unpackb(frames[0], strict_map_key=False)
        header[rng.choice(["v", "type", "id", "body", "tensors", "status"])] = _random_value(rng)
        frames[0] = msgpack.packb(header)
        return frames
    else:  # a random tensor descriptor
        header = msgpack.unpackb(frames[0], strict_map_key=False)
        header["tensors"] = [{"dtype": _random_value(rng), "shape": _random_value(rng)}]
        frames[0] = msgpack.packb(header)
        return frames
    frames[i] = bytes(data)
    return frames


def _fuzz_message(rng: random.Random, templates: list[list[bytes]]) -> list[bytes]:
    roll = rng.random()
    if roll < 0.2:
        return [rng.randbytes(rng.randrange(1, 200))]
    if roll < 0.35:
        header = {
            "v": rng.choice([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, "1"]),
            "type": _random_value(rng),
            "id": _random_value(rng),
            "body": _random_value(rng),
            "tensors": _random_value(rng),
        }
        return [msgpack.packb(header, use_bin_type=True)]
    if roll < 0.45:
        return [msgpack.packb(_random_value(rng), use_bin_type=True)]
    return _mutate(rng, rng.choice(templates))


async def test_ten_thousand_hostile_messages_change_nothing(small_hsi) -> None:
    rng = random.Random(20261121)
    async with (
        live_server(small_hsi, mode="async", epochs=1000, dead_after_s=600) as ps,
        clients(ps.address, 2) as (honest, fuzzer),
    ):
        await honest.join("honest", speed=50.0)  # training is under way, a task is outstanding
        before = published(ps)
        version = ps.updater.version
        templates = _templates(ps.state_size)

        replies = {"error": 0, "ok": 0}
        sent = 0
        while sent < MESSAGES:
            batch = [_fuzz_message(rng, templates) for _ in range(min(BATCH, MESSAGES - sent))]
            for frames in batch:
                await fuzzer.sock.send_multipart(frames)
            for _ in batch:
                frames = await asyncio.wait_for(fuzzer.sock.recv_multipart(), 30)
                header = msgpack.unpackb(frames[0])
                replies[header["status"]] += 1
            sent += len(batch)

        assert sum(replies.values()) == MESSAGES
        assert replies["error"] > 0.9 * MESSAGES
        assert ps.updater.version == version
        assert torch.equal(published(ps), before)  # bit-identical
        status = await honest.request(StatusRequest())
        assert isinstance(status, StatusReply) and status.status["version"] == version
        assert status.status["workers"][0]["name"] == "honest"


def _spoofed(
    rng: random.Random, honest: list[Member], tasks: dict[int, TaskReply], mallory: Member
):
    """One message claiming to be an honest worker (or reaching for its task) without its
    token: what a peer on the same network can send."""
    victim = rng.choice(honest)
    task = tasks[victim.worker_id]
    token = rng.choice(["0" * 32, mallory.token, rng.randbytes(16).hex(), "", "é" * 32])
    wid = rng.choice([victim.worker_id, mallory.worker_id])
    roll = rng.randrange(8)
    if roll == 0:
        return LeaveRequest(worker_id=victim.worker_id, token=token, reason="spoofed")
    if roll == 1:
        return HeartbeatRequest(worker_id=victim.worker_id, token=token)
    if roll == 2:
        return TaskRequest(worker_id=victim.worker_id, token=token, speed=rng.choice([1.0, 1e9]))
    if roll == 3:
        return push_request(victim, task, worker_id=wid, token=token)
    if roll == 4:  # mallory's own valid token, pushing the victim's task
        return push_request(mallory, task)
    if roll == 5:
        size = min(task.indices[0] + 1024, 4096)
        return GradientChunk(
            worker_id=wid,
            token=rng.choice([token, task.push_token if wid != victim.worker_id else token]),
            task_id=task.task_id,
            version=task.version,
            offset=0,
            scale=1.0,
            gradient=np.full(size, 1e3, dtype=np.float32),
        )
    if roll == 6:
        return PullRequest(worker_id=wid, token=token, min_version=0, offset=0, length=1024)
    return DataRequest(worker_id=victim.worker_id, token=token, indices=task.indices[:3])


async def test_spoofed_sequences_change_nothing_and_training_completes(small_hsi) -> None:
    rng = random.Random(7)
    async with (
        live_server(
            small_hsi, mode="weighted-sync", workers=2, global_batch=24, epochs=4, dead_after_s=600
        ) as ps,
        clients(ps.address, 3) as (a, b, fuzzer),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        join = await fuzzer.request(
            JoinRequest(name="mallory", device="cpu", slowdown=1, threads=1)
        )
        mallory = Member(join)  # a member, but never ready: it holds no task
        honest = [member_a, member_b]
        tasks = {member_a.worker_id: task_a, member_b.worker_id: task_b}
        before, version = published(ps), ps.updater.version
        sent = 0
        while sent < MESSAGES:  # phase 1: hostile messages alone
            count = min(BATCH, MESSAGES - sent)
            for _ in range(count):
                await fuzzer.send(_spoofed(rng, honest, tasks, mallory))
            for _ in range(count):
                frames = await asyncio.wait_for(fuzzer.sock.recv_multipart(), 30)
                assert msgpack.unpackb(frames[0])["status"] in ("ok", "error")
            sent += count
        assert ps.updater.version == version and torch.equal(published(ps), before)
        assert {w.name for w in ps.roster.members()} == {"a", "b", "mallory"}

        async def train(client, member, task):  # phase 2: honest training, fuzzing goes on
            while task.action == "train":
                values = np.full(ps.state_size, 1e-3, dtype=np.float32)
                task = await asyncio.wait_for(client.push(member, task, values), 30)

        async def harass():
            for _ in range(2000):
                await fuzzer.send(_spoofed(rng, honest, tasks, mallory))
                await asyncio.sleep(0)

        await asyncio.gather(train(a, member_a, task_a), train(b, member_b, task_b), harass())
        epochs = [e for e in ps.log.events if e["event"] == "epoch"]
        assert [e["epoch"] for e in epochs] == [1, 2, 3, 4]
        assert all(e["exactly_once"] for e in epochs)
        assert ps.run.finish_reason == "epochs"
