"""The live status page in a real headless Chromium, against a real server and workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.procs import Child
from tests.support import requirements
from tests.support.cluster import start_server, start_worker
from tests.support.paths import ROOT

CHROMIUM_NAMES = ("chromium", "chromium-browser")
DRAW_TIMEOUT_S = 120.0
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1300",
)


@pytest.fixture
def browser(
    pytestconfig: pytest.Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """A headless Debian Chromium driven by chromedriver; never downloads anything (skipped
    without it, failed under --require browser; 'make ci-deps' installs it)."""
    chromium = next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        requirements.missing(
            pytestconfig,
            "browser",
            "Chromium or chromedriver not installed (Debian: chromium, chromium-driver)",
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        requirements.missing(pytestconfig, "browser", "selenium is not installed")
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not try the network
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=20) as response:
        return json.loads(response.read())


def _cli_status(address: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "pserver.cli", "status", "--server", address],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _drawn(driver: Any) -> bool:
    return bool(
        driver.execute_script(
            "const rows = document.querySelectorAll('#workers tbody tr').length;"
            "const oa = document.getElementById('oa-line');"
            "return rows >= 2 && oa !== null && Number(oa.dataset.points) >= 2;"
        )
    )


@pytest.mark.parametrize("mode", ["weighted-sync", "async"])
@pytest.mark.exclusive  # the slow worker's share follows speeds
def test_live_page_in_chromium(browser: Any, small_hsi: Path, tmp_path: Path, mode: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    run_dir = tmp_path / "run"
    procs: list[Child] = []
    try:
        server, address = start_server(
            small_hsi, run_dir, "--workers", "2", "--epochs", "100000", "--global-batch", "16",
            "--http", "0", "--mode", mode, "--min-local-batch", "1",
        )  # fmt: skip
        procs.append(server)
        url = server.expect("status page on").split("status page on", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        procs += [start_worker(address, "fast", 1.0), start_worker(address, "slow", 3.0)]
        server.wait_for("epoch 2 done")
        server.wait_for(": OA ")  # two evaluations exist: a curve, not a dot

        browser.get(url)
        WebDriverWait(browser, DRAW_TIMEOUT_S, poll_frequency=0.25).until(_drawn)
        shot = run_dir / f"status_page_{mode}.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000

        rows = browser.execute_script(
            "return [...document.querySelectorAll('#workers tbody tr')]"
            ".map(r => [...r.cells].map(c => c.textContent));"
        )
        assert sorted(r[0] for r in rows) == ["fast", "slow"]
        assert all(r[3] == "training" and float(r[4]) > 0 for r in rows)  # state, speed
        assert all(r[5].endswith("%") for r in rows)  # batch share
        slow_share = next(float(r[5].split()[0]) for r in rows if r[0] == "slow")
        assert slow_share < 50  # the slow worker gets (sync) or does (async) the smaller share
        staleness = [r[7] for r in rows]
        if mode == "async":
            assert all(s.count(" / ") == 2 for s in staleness), staleness  # last / mean / max
        else:
            # idle time at the barrier: measured by the server (round events carry idle_s),
            # so not marked as derived ("≈")
            assert staleness == ["-", "-"] and all(r[8] and r[8][0].isdigit() for r in rows), rows
        segments = browser.execute_script(
            "return document.querySelectorAll('#timeline rect.compute').length"
        )
        assert segments > 0  # round segments (sync) or push ticks (async)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors  # e.g. a CSP refusal of the inline script or style

        before = _get_json(url + "status.json")
        cli = _cli_status(address)
        after = _get_json(url + "status.json")
        cli_after = _cli_status(address)
        assert set(before) == set(cli) == set(after) == set(cli_after)
        for key in ("mode", "model"):
            assert before[key] == cli[key] == after[key]
        # each view answers from its own short-lived snapshot (the page's at most 0.5 s old,
        # 'pserver status' at most 0.25 s), so the two need not agree while training runs,
        # but neither ever goes backwards
        for key in ("version", "steps", "samples_seen"):
            assert before[key] <= after[key] and cli[key] <= cli_after[key], key
        assert [w["name"] for w in before["workers"]] == [w["name"] for w in cli["workers"]]
        assert set(before["workers"][0]) == set(cli["workers"][0])

        server.popen.send_signal(signal.SIGTERM)
        assert server.wait(120) == 128 + signal.SIGTERM  # interrupted: says so, non-zero
        for proc in procs[1:]:
            assert proc.wait(120) == 0, proc.tail(30)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait(10)
            print(f"----- {proc.name} -----\n" + proc.tail(60))
        raise
    finally:
        for proc in procs:
            proc.kill()


@contextlib.contextmanager
def _page_in_thread(status: dict[str, Any], events: list[dict[str, Any]]) -> Iterator[str]:
    """A StatusPage with a fixed status map, served from its own event loop on a thread."""
    from pserver.observe.statuspage import StatusPage

    loop = asyncio.new_event_loop()
    page = StatusPage(lambda: status, events, clock=lambda: 5.0)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = asyncio.run_coroutine_threadsafe(page.start(), loop).result(30)
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(page.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_page_shows_shards_and_hostile_names_as_text(browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    hostile = "<img src=x onerror=\"document.title='pwned'\">"
    worker = {
        "id": 1,
        "ready": True,
        "name": hostile,
        "device": "cpu",
        "slowdown": 1.0,
        "speed": 50.0,
        "samples": 10,
        "pushes": 1,
        "rejected": 0,
        "active": True,
        "model": {"alpha_s": 0.002, "beta_s_per_sample": 0.0005, "transfer_s": 0.01},
    }
    status = {"mode": "weighted-sync", "model": "hsi-cnn", "version": 2, "epoch": 1,
              "steps": 2, "samples_seen": 20, "training": True, "finished": False,
              "waiting_for": 0, "last_eval": None, "workers": [worker],
              "shards": [{"index": 0, "address": "(this server)", "state": [0, 500],
                          "alive": True}]}  # fmt: skip
    events = [
        {"event": "train_start", "t": 1.0},
        {"event": "eval", "t": 2.0, "version": 1, "samples": 10, "oa": 0.4, "loss": 1.2},
        {"event": "eval", "t": 3.0, "version": 2, "samples": 20, "oa": 0.6, "loss": 0.9},
        {"event": "round", "t": 3.0, "round_s": 0.5, "version": 2,
         "workers": [{"worker": hostile, "batch": 10, "speed": 50.0, "transfer_s": 0.1}]},
    ]  # fmt: skip
    with _page_in_thread(status, events) as url:
        browser.get(url)
        WebDriverWait(browser, DRAW_TIMEOUT_S, poll_frequency=0.25).until(
            lambda d: d.execute_script("return document.body.dataset.updates") is not None
        )
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#workers tbody td')].map(c => c.textContent)"
        )
        shards = browser.execute_script(
            "return [...document.querySelectorAll('#shards tbody td')].map(c => c.textContent)"
        )
        hidden = browser.execute_script("return document.getElementById('shards-section').hidden")
        kinds = browser.execute_script(
            "return [...document.querySelectorAll('#timeline rect')].map(r => r.classList[0])"
        )
        images = browser.execute_script("return document.images.length")
        title = browser.title
    assert cells[0] == hostile and images == 0 and title != "pwned"  # text, never markup
    assert cells[6] == "2.0 ms + 0.50 ms·b + 10.0 ms"  # the fitted step model
    assert shards == ["0", "(this server)", "0 – 500", "alive true"] and hidden is False
    assert kinds == ["compute", "transfer", "idle"]  # 0.2 s + 0.1 s + 0.2 s
