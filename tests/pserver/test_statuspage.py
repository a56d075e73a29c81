"""The HTTP status page: status.json = ``pserver status``, /metrics format, binding, bounds."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from common.errors import ConfigError
from common.protocol.messages import JoinRequest, StatusReply, StatusRequest
from pserver.cli import main as pserver_main
from pserver.config import ServerConfig
from pserver.observe import statuspage
from pserver.observe.statuspage import MAX_CONNECTIONS, REFRESH_S, StatusPage
from tests.support.live import clients, live_server

TIMEOUT = aiohttp.ClientTimeout(total=20)
ODD_NAME = "w0:gpu@node-1+x.y"  # every character a worker name may hold


async def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(url) as response,
    ):
        return response.status, dict(response.headers), await response.read()


async def test_status_json_is_exactly_pserver_status(small_hsi: Path) -> None:
    async with (
        live_server(small_hsi, workers=2, http_port=0, dead_after_s=60.0) as server,
        clients(server.address, 1) as (client,),
    ):
        await client.request(JoinRequest(name=ODD_NAME, device="cpu", slowdown=2.0, threads=1))
        assert server.http.url.startswith("http://127.0.0.1:")
        status, headers, body = await _get(server.http.url + "status.json")
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert headers["Cache-Control"] == "no-store"
        assert headers["X-Content-Type-Options"] == "nosniff"
        reply = await client.request(StatusRequest())
        assert isinstance(reply, StatusReply)
        # The CLI blocks on its socket, so it runs on a thread while the loop serves it.
        cli = await asyncio.to_thread(
            CliRunner().invoke, pserver_main, ["status", "--server", server.address]
        )
        assert cli.exit_code == 0, cli.output
        page = json.loads(body)
        assert page == json.loads(cli.output) == reply.status
        assert page["workers"][0]["name"] == ODD_NAME and page["waiting_for"] == 2


async def test_metrics_parse_as_prometheus_text(small_hsi: Path) -> None:
    async with (
        live_server(small_hsi, workers=2, http_port=0, dead_after_s=60.0) as server,
        clients(server.address, 1) as (client,),
    ):
        await client.request(JoinRequest(name=ODD_NAME, device="cpu", slowdown=2.0, threads=1))
        status, headers, body = await _get(server.http.url + "metrics")
        assert status == 200
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = body.decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        # every family has HELP and TYPE lines (the parser would take defaults otherwise)
        for family in families.values():
            assert family.documentation and family.type in ("gauge", "counter")
        assert text.count("# TYPE ") == len(families)
        assert families["pserver_info"].samples[0].labels == {
            "mode": "weighted-sync",
            "model": "hsi-cnn",
        }
        assert families["pserver_version"].samples[0].value == server.updater.version
        assert families["pserver_waiting_for_workers"].samples[0].value == 2
        assert families["pserver_training"].samples[0].value == 0
        (speed,) = families["pserver_worker_slowdown"].samples
        assert speed.labels == {"worker": ODD_NAME, "device": "cpu"} and speed.value == 2.0
        (pushes,) = families["pserver_worker_pushes"].samples  # counter: '_total' dropped
        assert pushes.name == "pserver_worker_pushes_total" and pushes.value == 0
        assert "pserver_eval_oa" not in families  # no evaluation yet: no sample, not a fake 0


async def test_binds_loopback_only_by_default(small_hsi: Path) -> None:
    async with live_server(small_hsi, http_port=0) as server:
        port = server.http.port
        status, _, _ = await _get(f"http://127.0.0.1:{port}/status.json")
        assert status == 200
        with pytest.raises(OSError):  # 127.0.0.2 is loopback too, but not the bound address
            await asyncio.wait_for(asyncio.open_connection("127.0.0.2", port), 10)
    async with live_server(small_hsi, http_port=0, http_bind="0.0.0.0") as server:
        status, _, _ = await _get(f"http://127.0.0.2:{server.http.port}/status.json")
        assert status == 200


async def test_read_only_and_bounded(small_hsi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # held connections must outlive the time it takes to open them all on a busy machine
    monkeypatch.setattr(statuspage, "KEEPALIVE_S", 300.0)
    async with live_server(small_hsi, http_port=0) as server:
        url = server.http.url
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            for method in ("POST", "PUT", "DELETE"):
                async with session.request(method, url + "status.json", data=b"x") as r:
                    assert r.status == 405
            async with session.get(url + "nothing-here") as r:
                assert r.status == 404
            async with session.get(url, headers={"X-Big": "a" * 20000}) as r:
                assert r.status in (400, 431)
            async with session.head(url + "metrics") as r:
                assert r.status == 200
        held = []
        try:
            for _ in range(MAX_CONNECTIONS):  # each answered once, then kept open
                reader, writer = await asyncio.open_connection("127.0.0.1", server.http.port)
                writer.write(b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await asyncio.wait_for(reader.readline(), 20)).startswith(b"HTTP/1.1 200")
                held.append(writer)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.http.port)
            answer = await asyncio.wait_for(reader.read(), 20)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503")
        finally:
            for writer in held:
                writer.close()
        port = server.http.port
    with pytest.raises(OSError):  # closing the server closed the page
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)


async def test_page_is_self_contained(small_hsi: Path) -> None:
    async with live_server(small_hsi, http_port=0) as server:
        status, headers, body = await _get(server.http.url)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    html = body.decode()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html and " src=" not in html
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy


def test_config_validates_http_options(small_hsi: Path) -> None:
    base = {"dataset": small_hsi, "model": "hsi-cnn", "epochs": 1}
    with pytest.raises(ConfigError, match="--http must be a port"):
        ServerConfig(**base, http_port=70000).validate()
    with pytest.raises(ConfigError, match=r"--http-bind 'example\.org'"):
        ServerConfig(**base, http_port=0, http_bind="example.org").validate()
    assert ServerConfig(**base).validate().http_port is None  # off by default
    help_text = CliRunner().invoke(pserver_main, ["start", "--help"]).output
    assert "--http INTEGER" in help_text and "--http-bind TEXT" in help_text
    assert "default: 127.0.0.1" in help_text


async def test_pollers_are_answered_from_a_cached_body_while_the_loop_is_busy() -> None:
    """200 concurrent pollers cost the server's loop one render per ``REFRESH_S``, and are
    answered even while that loop is busy (the page serves from its own thread)."""
    renders = []

    def status() -> dict[str, int]:
        renders.append(1)
        return {"version": len(renders)}

    page = StatusPage(status, (), clock=lambda: 1.0)
    url = await page.start()
    try:
        assert (await _get(url + "status.json"))[0] == 200
        begin = time.monotonic()
        answers = await asyncio.gather(*(_get(url + "status.json") for _ in range(200)))
        spent = time.monotonic() - begin
        assert [a[0] for a in answers] == [200] * 200
        assert len(renders) <= 2 + spent / REFRESH_S, (len(renders), spent)
        answered = threading.Event()

        def poll() -> None:
            with urllib.request.urlopen(url + "status.json", timeout=10) as response:
                if response.status == 200 and json.loads(response.read())["version"] >= 1:
                    answered.set()

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(2.0)  # the server's loop is busy (an update, an evaluation) for 2 s
        assert answered.is_set()
        poller.join(10)
    finally:
        await page.close()


async def test_a_render_that_fails_is_answered_503_and_tried_again() -> None:
    """A status map that cannot be rendered once is a 503 for the request that waited for
    it; the next request asks for a new one (the kind is not left unrendered for good)."""
    calls = []

    def status() -> dict[str, int]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the status map cannot be made right now")
        return {"version": len(calls)}

    async def until_served() -> bytes:
        while True:
            code, _, body = await _get(url + "status.json")
            if code == 200:
                return body
            assert code == 503
            await asyncio.sleep(0.1)

    page = StatusPage(status, (), clock=lambda: 1.0)
    url = await page.start()
    try:
        assert (await _get(url + "status.json"))[0] == 503
        body = await asyncio.wait_for(until_served(), 15)
        assert json.loads(body)["version"] >= 2
    finally:
        await page.close()


async def test_members_with_one_name_get_unique_names_and_metrics_series(
    small_hsi: Path,
) -> None:
    """``w-3`` joins first, then ``w`` twice: the third member (id 3) must not become a
    second ``w-3``, or ``/metrics`` would carry the same series twice."""
    async with (
        live_server(small_hsi, workers=4, http_port=0, dead_after_s=60.0) as server,
        clients(server.address, 3) as members,
    ):
        for client, name in zip(members, ("w-3", "w", "w"), strict=True):
            await client.request(JoinRequest(name=name, device="cpu", slowdown=1.0, threads=1))
        names = [w.name for w in server.roster.workers.values()]
        assert len(set(names)) == 3, names
        _, _, body = await _get(server.http.url + "metrics")
    series = [
        line.rsplit(" ", 1)[0] for line in body.decode().splitlines() if not line.startswith("#")
    ]
    assert len(series) == len(set(series)), series
