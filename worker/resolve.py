"""Fail fast on a server address whose host name does not resolve."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from common.errors import ConfigError


def check_server_host(endpoint: str) -> None:
    """Resolve the host of a ``tcp://HOST:PORT`` endpoint once, before connecting.

    ZeroMQ retries an unresolvable name silently until the connect timeout, so a typo in
    ``--server`` would cost the whole ``--connect-timeout``; this turns it into an error at once.
    Other transports (``ipc://``, ``inproc://``) are not checked.

    Args:
        endpoint: the ``--server`` value.

    Raises:
        ConfigError: the host name cannot be resolved.
    """
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.hostname == "*":
        return
    try:
        socket.getaddrinfo(parts.hostname, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"--server {endpoint!r}: host {parts.hostname!r} cannot be resolved ({exc}); "
            "check the name, or give the server's IP address"
        ) from None
