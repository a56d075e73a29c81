"""CURVE encryption and authentication for the server and worker sockets (ZeroMQ certificates),
and the secret a parameter shard proves to its coordinator."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import shutil
from pathlib import Path

import zmq
import zmq.auth

from common.config import need
from common.errors import ConfigError

AUTHORIZED_DIR = "authorized_keys"
SHARD_SECRET_MIN_BYTES = 16
_CURVE_SHARD_SECRET = b"rs-pserver shard secret"

log = logging.getLogger(__name__)


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


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read ZeroMQ certificate {str(path)!r}: {exc}") from exc


def load_client_keys(server_key: Path, secret_file: Path) -> ClientKeys:
    """Read ``--curve-server-key`` and ``--curve-secret``.

    Raises:
        ConfigError: a file is missing, malformed, or the secret file has no secret key.
    """
    return ClientKeys(_load(server_key)[0], *load_server_secret(secret_file))


def load_server_secret(secret_file: Path) -> tuple[bytes, bytes]:
    """The server's (public, secret) key pair from its ``.key_secret`` file.

    Raises:
        ConfigError: missing, malformed or without a secret key.
    """
    public, secret = _load(secret_file)
    if not secret:
        raise ConfigError(f"{str(secret_file)!r} holds no secret key; give the .key_secret file")
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


def shard_secret(secret_file: Path | None, curve_secret: Path | None) -> bytes:
    """The secret that parameter shards prove to their coordinator.

    It is the content of ``secret_file`` (the same file for the coordinator and every shard),
    else derived from the CURVE server secret key that both hold.

    Args:
        secret_file: ``--shard-secret-file`` / ``pserver shard --secret-file``, or None.
        curve_secret: the server's CURVE ``.key_secret`` file, or None.

    Returns:
        The secret (at least 16 bytes).

    Raises:
        ConfigError: neither is given, the file cannot be read or holds too few bytes.
    """
    if secret_file is not None:
        try:
            secret = secret_file.read_bytes()
            mode = secret_file.stat().st_mode
        except OSError as exc:
            raise ConfigError(f"cannot read the shard secret {str(secret_file)!r}: {exc}") from None
        need(
            len(secret.strip()) >= SHARD_SECRET_MIN_BYTES,
            f"the shard secret {str(secret_file)!r} holds fewer than "
            f"{SHARD_SECRET_MIN_BYTES} bytes; make one with: head -c 32 /dev/urandom > FILE",
        )
        if mode & 0o077:
            log.warning("the shard secret %s is readable by others: chmod 600 it", secret_file)
        return secret
    if curve_secret is not None:
        _, key = load_server_secret(curve_secret)
        return hmac.new(key, _CURVE_SHARD_SECRET, hashlib.sha256).digest()
    raise ConfigError(
        "parameter shards need a secret shared with the coordinator: give the same "
        "--shard-secret-file (pserver start) and --secret-file (pserver shard), or CURVE keys"
    )


def hello_proof(secret: bytes, address: str, name: str) -> str:
    """What a shard's hello carries to show it holds ``secret`` (an HMAC of its address and name).

    Args:
        secret: the shard secret.
        address, name: the hello's fields.

    Returns:
        The proof (hex).
    """
    text = f"shard_hello\0{address}\0{name}".encode()
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def check_hello_proof(secret: bytes, address: str, name: str, proof: str) -> bool:
    """Whether ``proof`` shows that the sender of a hello holds ``secret``."""
    return proof.isascii() and hmac.compare_digest(hello_proof(secret, address, name), proof)


def write_shard_secret(path: Path) -> Path:
    """Write a fresh shard secret (32 random bytes) to a new file only its owner can read.

    Args:
        path: where; it must not exist yet (a file or link planted there is refused).

    Returns:
        ``path``.

    Raises:
        OSError: ``path`` exists or cannot be created.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(32))
    return path
