"""CURVE: only authorized keys get answers; an authorized worker trains end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from common.errors import ConfigError, ErrorCode, RemoteError
from common.protocol.messages import REPLIES, StatusReply, StatusRequest, parse_message
from common.protocol.security import hello_proof, is_loopback, load_client_keys
from common.protocol.shard_messages import CONTROL_REPLIES, ShardHello
from tests.support.live import live_server

NO_REPLY_S = 1.5


async def _status_reply(
    address: str, keys: dict[str, Path] | None, secret: str = "worker_secret"
) -> StatusReply | None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        server_public, _ = zmq.auth.load_certificate(keys["server"])
        public, private = zmq.auth.load_certificate(keys[secret])
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            server_public,
            public,
            private,
        )
    sock.connect(address)
    try:
        await sock.send_multipart(StatusRequest().to_wire(1))
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), NO_REPLY_S * 2)
        except TimeoutError:
            return None
        reply, _ = parse_message(frames, REPLIES)
        assert isinstance(reply, StatusReply)
        return reply
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_plain_and_unknown_clients_get_no_reply(small_hsi: Path, curve_keys) -> None:
    async with live_server(
        small_hsi,
        curve_secret=curve_keys["server_secret"],
        authorized_keys=curve_keys["authorized_keys"],
    ) as ps:
        authorized = await _status_reply(ps.address, curve_keys)
        assert authorized is not None and authorized.status["mode"] == "weighted-sync"
        assert await _status_reply(ps.address, None) is None
        assert await _status_reply(ps.address, curve_keys, "stranger_secret") is None
        assert await _status_reply(ps.address, curve_keys) is not None  # still serving


def test_clear_text_warning_only_off_loopback() -> None:
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:5555")
    assert is_loopback("tcp://localhost:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://10.1.2.3:5555")


def test_client_keys_need_readable_certificates_and_a_secret_key(curve_keys, tmp_path) -> None:
    keys = load_client_keys(curve_keys["server"], curve_keys["worker_secret"])
    assert keys.server_public == zmq.auth.load_certificate(curve_keys["server"])[0]
    assert (keys.public, keys.secret) == zmq.auth.load_certificate(curve_keys["worker_secret"])
    with pytest.raises(ConfigError, match=r"holds no secret key; give the \.key_secret file"):
        load_client_keys(curve_keys["server"], curve_keys["worker"])
    with pytest.raises(ConfigError, match="cannot read ZeroMQ certificate"):
        load_client_keys(tmp_path / "missing.key", curve_keys["worker_secret"])


async def test_a_worker_key_cannot_register_a_shard(small_hsi: Path, curve_keys) -> None:
    """Under CURVE the worker key reaches the coordinator, but a hello must prove the secret
    derived from the server key, which workers do not hold."""
    async with live_server(
        small_hsi,
        shards=2,
        curve_secret=curve_keys["server_secret"],
        authorized_keys=curve_keys["authorized_keys"],
    ) as ps:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        load_client_keys(curve_keys["server"], curve_keys["worker_secret"]).apply(sock)
        sock.connect(ps.address)
        try:
            worker_secret = zmq.auth.load_certificate(curve_keys["worker_secret"])[1]
            assert worker_secret is not None
            for secret in (worker_secret, b"guess" * 4):
                address = "tcp://127.0.0.1:5999"
                proof = hello_proof(secret, address, "mallory")
                hello = ShardHello(address=address, name="mallory", proof=proof)
                await sock.send_multipart(hello.to_wire(1))
                frames = await asyncio.wait_for(sock.recv_multipart(), 10)
                with pytest.raises(RemoteError) as refused:
                    parse_message(frames, CONTROL_REPLIES)
                assert refused.value.code == ErrorCode.UNAUTHORIZED
        finally:
            sock.close(linger=0)
            ctx.term()
        assert ps.stores.links == []
