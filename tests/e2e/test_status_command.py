"""``pserver status`` as a process against a live server."""

from __future__ import annotations

import asyncio
import json
import sys

from common.protocol.messages import (
    JoinRequest,
)
from tests.support.live import clients, live_server


async def test_status_command_reports_mode_version_and_workers(small_hsi) -> None:
    async with (
        # the client never heartbeats: keep it a member while `pserver status` starts up
        live_server(small_hsi, mode="weighted-sync", workers=2, dead_after_s=120.0) as ps,
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
        assert status["epoch"] == 0 and status["epochs_done"] == 0  # training has not started
        assert status["waiting_for"] == 2  # none calibrated yet
        assert [w["name"] for w in status["workers"]] == ["slow-node"]
        assert {"speed", "samples"} <= set(status["workers"][0])
        assert status["workers"][0]["ready"] is False
