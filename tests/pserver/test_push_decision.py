"""A push is decided once by the mode policy and answered by its own handler: a recording
policy counts the calls the server makes through the policy interface for one real push."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from common.protocol.messages import TaskReply
from pserver import server as server_module
from pserver.policies import POLICIES
from tests.support.live import clients, live_server


class Recording:
    """Stands in for a mode policy: forwards every call to a real one and records its name
    (calls the policy makes to itself do not pass through here)."""

    def __init__(self, policy: Any, calls: list[str]) -> None:
        self._policy, self._calls = policy, calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._policy, name)
        if not callable(value):
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(name)
            return value(*args, **kwargs)

        return recorded


@pytest.mark.parametrize("mode", ["async", "weighted-sync", "equal-sync"])
async def test_one_push_is_decided_published_and_settled_once_each(
    small_hsi, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    calls: list[str] = []
    real = POLICIES[mode]
    policies = {**POLICIES, mode: lambda *args, **kw: Recording(real(*args, **kw), calls)}
    monkeypatch.setattr(server_module, "POLICIES", policies)
    async with (
        live_server(small_hsi, mode=mode, workers=1, global_batch=16, epochs=5) as ps,
        clients(ps.address, 1) as (client,),
    ):
        member, task = await client.join("only")
        assert calls, "the server did not plan through the recording policy"
        calls.clear()
        gradient = np.full(ps.state_size, 1e-4, dtype=np.float32)
        reply = await client.push(member, task, gradient)
        assert isinstance(reply, TaskReply) and reply.action == "train"
        assert ps.updater.version == 1
        # decided, published (planning what follows), the pusher's next task, settled after
        assert calls == ["decide", "after_update", "runnable", "settle"]
