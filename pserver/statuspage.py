"""The read-only HTTP status page of ``pserver start --http``: the page, status.json, metrics."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

from aiohttp import web

from common.errors import ConfigError
from pserver import prometheus
from pserver.liveview import LiveView

log = logging.getLogger(__name__)

StatusProvider = Callable[[], Mapping[str, Any]]

MAX_CONNECTIONS = 32
KEEPALIVE_S = 5.0
SHUTDOWN_S = 2.0
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (only its own inline script and style,
    fetches to this server only: the browser itself refuses any external resource)."""
    html = resources.files("pserver").joinpath("static/status.html").read_text(encoding="utf-8")

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


class _Refuse(asyncio.Protocol):
    """Answers a connection beyond the cap with 503 and closes it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY)
        transport.close()


class StatusPage:
    """Serves the live page, the status map and Prometheus metrics on the caller's event loop.

    Read-only (GET and HEAD only) and bounded: at most ``MAX_CONNECTIONS`` open connections
    (more get 503 at once), small header limits, no request body, idle keep-alive closed
    after ``KEEPALIVE_S``. Every handler answers at once (nothing awaited) from bounded data,
    the status map and a ``LiveView``, so no request can hold the event loop for long.

    Args:
        status: returns what ``pserver status`` answers (called per request, on the loop).
        events: the run log's events so far (replayed into the live view).
        clock: seconds since the run started.
        host: address to bind (``127.0.0.1`` unless told otherwise).
        port: port to bind (0: the kernel picks one).
    """

    def __init__(
        self,
        status: StatusProvider,
        events: Iterable[Mapping[str, Any]],
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
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    def on_event(self, record: Mapping[str, Any]) -> None:
        """Take a run-log event into the live view (a ``RunLog`` sink)."""
        self.view(record)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve in the background.

        Returns:
            The page's URL, e.g. ``http://127.0.0.1:8080/``.

        Raises:
            OSError: the address cannot be bound.
        """
        app = web.Application(middlewares=[_headers], client_max_size=1024)
        app.router.add_get("/", self._index)
        app.router.add_get("/status.json", self._status)
        app.router.add_get("/history.json", self._history)
        app.router.add_get("/metrics", self._metrics)
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
                self._protocol, self.host, self.port, backlog=16
            )
        except OSError:
            await self._runner.cleanup()
            raise
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.port = port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}/"
        if host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("status page bound to %s: anyone who reaches this host can read it", host)
        return self.url

    def _protocol(self) -> asyncio.BaseProtocol:
        """One protocol per accepted connection: aiohttp's, or a refusal beyond the cap."""
        assert self._runner is not None and self._runner.server is not None
        if len(self._runner.server.connections) >= MAX_CONNECTIONS:
            return _Refuse()
        return self._runner.server()

    async def close(self) -> None:
        """Stop listening and close every connection (bounded by ``SHUTDOWN_S``)."""
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

    # --- requests ----------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._html,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": self._policy, "Referrer-Policy": "no-referrer"},
        )

    async def _status(self, request: web.Request) -> web.Response:
        return _json(self.status())  # as 'pserver status' prints it

    async def _history(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.view.to_json(self.clock()).encode("utf-8"), content_type="application/json"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        text = prometheus.render(self.status(), self.view.snapshot(with_evals=False))
        return web.Response(
            body=text.encode("utf-8"), headers={"Content-Type": prometheus.CONTENT_TYPE}
        )


@web.middleware
async def _headers(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    response = await handler(request)
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def _json(data: Mapping[str, Any]) -> web.Response:
    return web.Response(
        body=json.dumps(data, default=str).encode("utf-8"), content_type="application/json"
    )


async def start_for_server(server: Any) -> StatusPage:
    """Start the status page of a ``ParameterServer`` and attach it to its run log.

    Args:
        server: the parameter server (its ``config.http_port``/``http_bind``, ``log``).

    Returns:
        The running page; close it with ``await page.close()``.

    Raises:
        ConfigError: the address cannot be bound.
    """
    from pserver.summary import status_of

    page = StatusPage(
        lambda: status_of(server),
        server.log.events,
        server.log.now,
        server.config.http_bind,
        server.config.http_port,
    )
    try:
        url = await page.start()
    except OSError as exc:
        raise ConfigError(
            f"--http {server.config.http_port} --http-bind {server.config.http_bind}: {exc}"
        ) from exc
    server.log.add_sink(page.on_event)
    server.log.event("http", url=url)
    log.info("status page on %s", url)
    return page
