"""The servers' event loop: uvloop where it is installed, the standard loop on request."""

from __future__ import annotations

import asyncio

import pytest

from common import eventloop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_servers_run_on_uvloop_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.run(_loop_module()).startswith("uvloop")


def test_the_standard_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "asyncio")
    assert eventloop.loop_factory() is None
    assert eventloop.run(_loop_module()).startswith("asyncio")
