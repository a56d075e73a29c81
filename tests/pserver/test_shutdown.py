"""The end of a run on a live server: a stop answers the workers waiting in a round, writes the
final checkpoint and evaluation of the last version and the summary, and stays within
``--shutdown-timeout`` when a worker never collects its stop."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from pathlib import Path

import numpy as np

from common.protocol.messages import JoinRequest, TaskReply
from tests.support.cluster import events, summary
from tests.support.live import clients, live_server

QUIET_S = 0.5  # how long a push that must wait at the barrier is watched


async def test_a_stop_answers_a_worker_waiting_in_a_round_and_saves_the_last_version(
    small_hsi: Path, tmp_path: Path
) -> None:
    async with (
        live_server(small_hsi, workers=2, epochs=100, run_dir=tmp_path) as ps,
        clients(ps.address, 2) as (a, b),
    ):
        (member_a, task_a), (member_b, task_b) = await asyncio.gather(a.join("a"), b.join("b"))
        zeros = np.zeros(ps.state_size, dtype=np.float32)
        task_a, task_b = await asyncio.gather(
            a.push(member_a, task_a, zeros), b.push(member_b, task_b, zeros)
        )
        waiting = asyncio.ensure_future(a.push(member_a, task_a, zeros))
        done, _ = await asyncio.wait({waiting}, timeout=QUIET_S)
        assert not done  # round 2 waits for b
        ps.request_stop()
        stopped = await asyncio.wait_for(waiting, 30)
        assert isinstance(stopped, TaskReply) and stopped.action == "stop"
        late = await b.push(member_b, task_b, zeros)
        assert isinstance(late, TaskReply) and late.action == "stop"
    result = summary(tmp_path)
    assert (result["finish_reason"], result["steps"]) == ("stopped", 1)
    assert (tmp_path / "checkpoints/ckpt-0000000001.npz").is_file()
    finals = [e for e in events(tmp_path) if e["event"] == "eval" and e.get("final")]
    assert [e["version"] for e in finals] == [1]


async def test_a_worker_that_never_collects_its_stop_does_not_hold_up_the_end(
    small_hsi: Path, tmp_path: Path
) -> None:
    budget_s = 2.0
    options = dict(mode="async", run_dir=tmp_path, shutdown_timeout_s=budget_s, dead_after_s=60)
    async with live_server(small_hsi, **options) as ps, clients(ps.address, 2) as (a, idle):
        member, task = await a.join("a")
        await idle.request(JoinRequest(name="idle", device="cpu", slowdown=1.0, threads=1))
        await a.push(member, task, np.zeros(ps.state_size, dtype=np.float32))
        stop_at = time.monotonic()
        ps.request_stop()  # the block's end waits for the server to finish
    took = time.monotonic() - stop_at
    assert took < budget_s + 3.0, f"the end took {took:.1f} s with a {budget_s} s budget"
    result = summary(tmp_path)
    assert (result["finish_reason"], result["steps"]) == ("stopped", 1)
    pushes = {w["name"]: w["pushes"] for w in result["workers"]}
    assert pushes["a"] == 1


async def test_a_closed_server_can_be_collected(small_hsi: Path) -> None:
    """What a server froze out of the collector's reach at start is returned to it at close,
    so the closed server's cycles are freed (a process may run one server after another)."""
    async with live_server(small_hsi) as ps:
        server = weakref.ref(ps)
    del ps
    gc.collect()
    assert server() is None
