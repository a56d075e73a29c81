"""The read-only HTTP status page of ``pserver start --http``: the page, status.json, metrics.

The page is served by its own thread and event loop, from bodies the server's loop renders at
most every ``REFRESH_S`` per kind (and only while someone asks), so pollers cost the training
loop a bounded, small share however many there are; a request-rate cap bounds the page thread.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

from aiohttp import web

from common.errors import ConfigError
from common.training.runlog import RunLog
from pserver.observe import prometheus
from pserver.observe.liveview import LiveView

log = logging.getLogger(__name__)

StatusProvider = Callable[[], Mapping[str, Any]]

MAX_CONNECTIONS = 256
KEEPALIVE_S = 5.0
SHUTDOWN_S = 2.0
REFRESH_S = 0.5  # the server renders each kind of body at most this often
FIRST_BODY_S = 10.0  # how long a request waits for the first body of its kind
MAX_REQUESTS_S = 400.0  # requests per second served at most (more get 503)
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
BODIES = ("status.json", "history.json", "metrics")


def _page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (only its own inline script and style,
    fetches to this server only: the browser itself refuses any external resource)."""
    html = (
        resources.files("pserver.observe")
        .joinpath("static/status.html")
        .read_text(encoding="utf-8")
    )

    def digest(tag: str) -> str:
        match = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        assert match is not None, f"status.html has no <{tag}>"
        return base64.b64encode(hashlib.sha256(match.group(1).encode()).digest()).decode()

    policy = (
        "default-src 'none'; "
        f"script-src 'sha256-{digest('script')}'; "
        f"style-src 'sha256-{digest('style')}'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return html.encode("utf-8"), policy


class _RequestBudget:
    """A token bucket: ``rate`` requests per second, bursts up to one second's worth."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, rate, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class _Bodies:
    """The latest rendered body of each kind, shared by the server's loop (which renders them)
    and the page's loop (which serves them).

    Args:
        render: makes the body of a kind (called on the server's loop only).
    """

    def __init__(self, render: Callable[[str], bytes]) -> None:
        self.render = render
        self._lock = threading.Lock()
        self._bodies: dict[str, tuple[float, bytes]] = {}
        self._wanted: set[str] = set()
        self._owner: asyncio.AbstractEventLoop | None = None
        self._page: asyncio.AbstractEventLoop | None = None
        self._first: dict[str, asyncio.Event] = {}

    def attach(self, owner: asyncio.AbstractEventLoop, page: asyncio.AbstractEventLoop) -> None:
        """Render on ``owner`` (the server's loop), serve on ``page``."""
        self._owner, self._page = owner, page
        self._first = {name: asyncio.Event() for name in BODIES}  # made on the page's loop

    async def get(self, name: str) -> bytes | None:
        """The latest body of ``name`` (on the page's loop); asks for a new one when it is
        older than ``REFRESH_S`` (one at a time per kind). None if the first one did not
        come within ``FIRST_BODY_S`` or its render failed."""
        assert self._owner is not None
        with self._lock:
            made = self._bodies.get(name)
            stale = made is None or time.monotonic() - made[0] >= REFRESH_S
            if stale and name not in self._wanted:
                self._wanted.add(name)
                self._owner.call_soon_threadsafe(self._refresh, name)
        if made is not None:
            return made[1]  # at most REFRESH_S old, or a newer one is on its way
        try:
            await asyncio.wait_for(self._first[name].wait(), FIRST_BODY_S)
        except TimeoutError:
            return None
        with self._lock:
            made = self._bodies.get(name)
        return None if made is None else made[1]

    def _refresh(self, name: str) -> None:
        """Render the body of ``name`` (on the server's loop); a render that fails is logged
        and asked for again by the next request."""
        try:
            body: bytes | None = self.render(name)
        except Exception:
            log.exception("status page: rendering %s failed", name)
            body = None
        with self._lock:
            if body is not None:
                self._bodies[name] = (time.monotonic(), body)
            self._wanted.discard(name)
        if self._page is not None and not self._page.is_closed():
            self._page.call_soon_threadsafe(self._first[name].set)


class _Refuse(asyncio.Protocol):
    """Answers a connection beyond the cap with 503 and closes it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY)
        transport.close()


class StatusPage:
    """Serves the live page, the status map and Prometheus metrics from a thread of its own.

    Read-only (GET and HEAD only) and bounded: at most ``MAX_CONNECTIONS`` open connections
    (more get 503 at once), at most ``MAX_REQUESTS_S`` requests a second (more get 503), small
    header limits, no request body, idle keep-alive closed after ``KEEPALIVE_S``. The bodies
    are rendered on the loop that started the page (the server's, which owns the status and
    the ``LiveView``), each kind at most every ``REFRESH_S`` and only when asked for, so a
    status.json is at most that old.

    Args:
        status: returns what ``pserver status`` answers (called on the starting loop).
        events: the run log's events so far (replayed into the live view).
        clock: seconds since the run started.
        host: address to bind (``127.0.0.1`` unless told otherwise).
        port: port to bind (0: the kernel picks one).
    """

    def __init__(
        self,
        status: StatusProvider,
        events: Iterable[Mapping[str, Any]],
        *,
        clock: Callable[[], float],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.status = status
        self.view = LiveView(events)
        self.clock = clock
        self.host, self.port = host, port
        self.url = ""
        self._html, self._policy = _page()
        self._bodies = _Bodies(self.render)
        self._budget = _RequestBudget(MAX_REQUESTS_S)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    def on_event(self, record: Mapping[str, Any]) -> None:
        """Take a run-log event into the live view (a ``RunLog`` sink, on the server's loop)."""
        self.view(record)

    def render(self, name: str) -> bytes:
        """The body of ``name`` (one of ``BODIES``) now; what a refresh costs the caller."""
        if name == "status.json":
            return json.dumps(self.status(), default=str).encode("utf-8")  # as 'pserver status'
        if name == "history.json":
            return self.view.to_json(self.clock()).encode("utf-8")
        return prometheus.render(self.status(), self.view.snapshot(with_evals=False)).encode()

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Start the page's thread, bind and serve; bodies are rendered on this loop.

        Returns:
            The page's URL, e.g. ``http://127.0.0.1:8080/``.

        Raises:
            OSError: the address cannot be bound.
        """
        owner = asyncio.get_running_loop()
        self._loop = loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="status-page", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._serve(owner), loop))
        except BaseException:
            self._stop_thread()
            raise
        host = self.host
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        if host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("status page bound to %s: anyone who reaches this host can read it", host)
        return self.url

    async def _serve(self, owner: asyncio.AbstractEventLoop) -> None:
        """Set up the app and listen (on the page's loop)."""
        assert self._loop is not None
        self._bodies.attach(owner, self._loop)
        app = web.Application(middlewares=[self._limit], client_max_size=1024)
        app.router.add_get("/", self._index)
        types = ("application/json", "application/json", prometheus.CONTENT_TYPE)
        for name, content_type in zip(BODIES, types, strict=True):
            app.router.add_get(f"/{name}", functools.partial(self._cached, name, content_type))
        self._runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=KEEPALIVE_S,
            max_line_size=4096,
            max_field_size=4096,
            max_headers=32,
            shutdown_timeout=SHUTDOWN_S,
            handler_cancellation=True,
        )
        await self._runner.setup()
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._protocol, self.host, self.port, backlog=128
            )
        except OSError:
            await self._runner.cleanup()
            raise
        self.host, self.port = self._listener.sockets[0].getsockname()[:2]

    def _protocol(self) -> asyncio.BaseProtocol:
        """One protocol per accepted connection: aiohttp's, or a refusal beyond the cap."""
        assert self._runner is not None and self._runner.server is not None
        if len(self._runner.server.connections) >= MAX_CONNECTIONS:
            return _Refuse()
        return self._runner.server()

    async def close(self) -> None:
        """Stop listening, close every connection (bounded by ``SHUTDOWN_S``), end the thread."""
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), 3 * SHUTDOWN_S)
        except TimeoutError:
            log.warning("status page: not closed after %.0f s; leaving it", 3 * SHUTDOWN_S)
        self._stop_thread()

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._listener is not None:
            try:
                await asyncio.wait_for(self._listener.wait_closed(), SHUTDOWN_S)
            except TimeoutError:
                log.warning("status page: connections still open after %.0f s", SHUTDOWN_S)
            self._listener = None

    def _stop_thread(self) -> None:
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(SHUTDOWN_S)
        if not thread.is_alive():
            loop.close()

    # --- requests (on the page's loop) -------------------------------------------------------

    @web.middleware
    async def _limit(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        """Refuse beyond the request budget; answers are never cached nor sniffed."""
        if not self._budget.take():
            return web.Response(status=503, headers={"Retry-After": "1"})
        response: web.StreamResponse = await handler(request)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._html,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": self._policy, "Referrer-Policy": "no-referrer"},
        )

    async def _cached(self, name: str, content_type: str, request: web.Request) -> web.Response:
        body = await self._bodies.get(name)
        if body is None:
            return web.Response(status=503, headers={"Retry-After": "1"})
        return web.Response(body=body, headers={"Content-Type": content_type})


async def start_page(
    status: Callable[[], dict[str, Any]], run_log: RunLog, bind: str, port: int
) -> StatusPage:
    """Start a server's status page and attach it to its run log.

    Args:
        status: returns what ``pserver status`` answers.
        run_log: the run log (its events feed the live view; the page's ``http`` event).
        bind: ``--http-bind``.
        port: ``--http``.

    Returns:
        The running page; close it with ``await page.close()``.

    Raises:
        ConfigError: the address cannot be bound.
    """
    page = StatusPage(status, run_log.events, clock=run_log.now, host=bind, port=port)
    try:
        url = await page.start()
    except OSError as exc:
        raise ConfigError(f"--http {port} --http-bind {bind}: {exc}") from exc
    run_log.add_sink(page.on_event)
    run_log.event("http", url=url)
    log.info("status page on %s", url)
    return page
