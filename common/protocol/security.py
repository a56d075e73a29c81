"""CURVE encryption and authentication for the server and worker sockets (ZeroMQ certificates)."""

from __future__ import annotations

import dataclasses
import ipaddress
import shutil
from pathlib import Path

import zmq
import zmq.auth

from common.errors import ConfigError

AUTHORIZED_DIR = "authorized_keys"


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """What a client socket needs for CURVE: the server's public key and its own key pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client (before it connects)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _load(path: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read ZeroMQ certificate {str(path)!r}: {exc}") from exc
    if need_secret and not secret:
        raise ConfigError(f"{str(path)!r} holds no secret key; give the .key_secret file")
    return public, secret


def load_client_keys(server_key: Path, secret_file: Path) -> ClientKeys:
    """Read ``--curve-server-key`` and ``--curve-secret``.

    Raises:
        ConfigError: a file is missing, malformed, or the secret file has no secret key.
    """
    server_public, _ = _load(server_key, need_secret=False)
    public, secret = _load(secret_file, need_secret=True)
    assert secret is not None
    return ClientKeys(server_public, public, secret)


def load_server_secret(secret_file: Path) -> tuple[bytes, bytes]:
    """The server's (public, secret) key pair from its ``.key_secret`` file.

    Raises:
        ConfigError: missing, malformed or without a secret key.
    """
    public, secret = _load(secret_file, need_secret=True)
    assert secret is not None
    return public, secret


def server_as_client(secret_file: Path) -> ClientKeys:
    """CURVE keys for the coordinator talking to its shards, which use the same server key
    pair and accept that key besides the workers' (see ``AuthorizedKeys``)."""
    public, secret = load_server_secret(secret_file)
    return ClientKeys(public, public, secret)


class AuthorizedKeys:
    """A CURVE credentials provider: the public keys in a directory, plus extra ones.

    Args:
        directory: ``*.key`` files (``pserver keygen`` writes ``authorized_keys/``).
        extra: more z85 public keys to allow (a shard allows its coordinator's).
    """

    def __init__(self, directory: Path, extra: tuple[bytes, ...] = ()) -> None:
        try:
            loaded = zmq.auth.load_certificates(str(directory))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read authorized keys in {str(directory)!r}: {exc}") from exc
        self.keys = {*loaded, *extra}

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether ``key`` (z85) may connect."""
        return key in self.keys


def generate(directory: Path) -> dict[str, Path]:
    """Write a server and a worker key pair, and authorize the worker's public key.

    Returns:
        The files written, by role: ``server``, ``server_secret``, ``worker``,
        ``worker_secret``, ``authorized_keys`` (a directory holding ``worker.key``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    server_public, server_secret = zmq.auth.create_certificates(directory, "server")
    worker_public, worker_secret = zmq.auth.create_certificates(directory, "worker")
    authorized = directory / AUTHORIZED_DIR
    authorized.mkdir(exist_ok=True)
    shutil.copy(worker_public, authorized / "worker.key")
    for secret in (server_secret, worker_secret):
        Path(secret).chmod(0o600)
    return {
        "server": Path(server_public),
        "server_secret": Path(server_secret),
        "worker": Path(worker_public),
        "worker_secret": Path(worker_secret),
        "authorized_keys": authorized,
    }


def is_loopback(endpoint: str) -> bool:
    """True when a ``tcp://HOST:PORT`` endpoint only listens on this machine."""
    if not endpoint.startswith("tcp://"):
        return True  # ipc:// and inproc:// never leave the machine
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or interface name, or "*"
