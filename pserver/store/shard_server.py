"""``pserver shard``: one parameter shard server, placed on a worker host.

It binds its own socket, says hello to the coordinator, receives its range of the state and
then serves workers' gradient chunks and pulls for that range, and the coordinator's commands.
It exits when the coordinator says so, or when the coordinator stays silent too long.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import numpy as np
import torch

from common import stagetrace
from common.errors import (
    ErrorCode,
    NetworkTimeout,
    ProtocolError,
    PSError,
    RemoteError,
)
from common.protocol.aclient import AsyncConnection
from common.protocol.base import Message
from common.protocol.messages import STORE_REQUESTS, GradientChunk, PullRequest
from common.protocol.security import hello_proof, server_as_client, shard_secret
from common.protocol.shard_messages import (
    CONTROL_REPLIES,
    CONTROL_REQUESTS,
    AbortRequest,
    AckReply,
    CaptureRequest,
    DropRequest,
    PingReply,
    PingRequest,
    PrepareReply,
    PrepareRequest,
    PublishRequest,
    ShardHello,
    ShardWelcome,
    ShutdownRequest,
    StagedReply,
    StagedRequest,
    StateReply,
)
from common.protocol.tokens import TokenBook
from pserver.config import ShardConfig, advertised
from pserver.store.build import make_optimizer
from pserver.store.service import StoreService
from pserver.store.slices import SliceStore
from pserver.transport import Endpoint, Request, TaskOwner

log = logging.getLogger(__name__)

HELLO_RETRY_S = 1.0


class ShardServer:
    """One shard: serves its slice until the coordinator ends the run.

    Args:
        config: the shard configuration.
    """

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        stagetrace.start("shard")
        torch.set_num_threads(config.torch_threads)
        self.owner = TaskOwner()
        self.endpoint = Endpoint(
            config.bind,
            {**STORE_REQUESTS, **CONTROL_REQUESTS},
            max_message_bytes=256 << 20,
            owner=self.owner,
            curve_secret=config.curve_secret,
            authorized_keys=config.authorized_keys,
            allow_own_key=True,
        )
        self.secret = shard_secret(config.secret_file, config.curve_secret)
        self.service: StoreService | None = None
        self.key = ""
        self.index = -1
        self._done = asyncio.Event()
        self._reason, self._ended = "", False  # why it stopped; whether the coordinator said so
        self._last_heard = time.monotonic()
        self._dead_after_s = 60.0

    async def run(self) -> tuple[str, bool]:
        """Register, serve, and return why the shard stopped and whether the coordinator ended
        the run (rather than a signal or its silence).

        Raises:
            NetworkTimeout: the coordinator never answered the hello.
            RemoteError: the coordinator refused the shard.
        """
        address = advertised(self.endpoint.bind(), self.config.advertise)
        welcome = await self._hello(address)
        self._adopt(welcome)
        log.info(
            "shard %d serves state [%d, %d) at %s", welcome.index, welcome.lo, welcome.hi, address
        )
        receiver = asyncio.create_task(self.endpoint.receive_loop(self.dispatch))
        watchdog = asyncio.create_task(self._watch())
        try:
            await self._done.wait()
        finally:
            for task in (receiver, watchdog):
                task.cancel()
            await asyncio.gather(receiver, watchdog, return_exceptions=True)
        return self._reason, self._ended

    async def _hello(self, address: str) -> ShardWelcome:
        cfg = self.config
        curve = None
        if cfg.curve_secret is not None:
            curve = server_as_client(cfg.curve_secret)
        deadline = time.monotonic() + cfg.connect_timeout_s
        log.info("connecting to the coordinator at %s", cfg.coordinator)
        while True:
            connection = AsyncConnection(
                self.endpoint.context, cfg.coordinator, replies=CONTROL_REPLIES, curve=curve
            )
            connection.start()
            try:
                left = max(deadline - time.monotonic(), 0.1)
                return await connection.request(
                    ShardHello(
                        address=address,
                        name=cfg.name[:64],
                        proof=hello_proof(self.secret, address, cfg.name[:64]),
                    ),
                    min(left, 10.0),
                    ShardWelcome,
                )
            except NetworkTimeout:
                if time.monotonic() >= deadline:
                    raise NetworkTimeout(
                        f"the coordinator at {cfg.coordinator} was never reached within "
                        f"--connect-timeout {cfg.connect_timeout_s:g} s"
                    ) from None
                await asyncio.sleep(HELLO_RETRY_S)
            finally:
                await connection.close()

    def _adopt(self, welcome: ShardWelcome) -> None:
        self.key, self.index = welcome.key, welcome.index
        self._dead_after_s = welcome.dead_after_s
        optimizer = make_optimizer(welcome)
        state = torch.from_numpy(np.array(welcome.state, dtype=np.float32))
        store = SliceStore(
            welcome.lo,
            welcome.hi,
            num_params=welcome.num_params,
            state=state,
            optimizer=optimizer,
            nonneg_bounds=list(welcome.nonneg_bounds),
            chunk_elems=welcome.chunk_elems,
            version=welcome.version,
        )
        if welcome.slots:
            rows = np.array(welcome.slot_state, dtype=np.float32).reshape(len(welcome.slots), -1)
            store.load_slots(list(welcome.slots), torch.from_numpy(rows), welcome.optimizer_steps)
        else:
            optimizer.steps = welcome.optimizer_steps
        self.service = StoreService(
            store,
            welcome.wire_dtype,
            tokens=TokenBook(welcome.store_token_key),
            replier=self.endpoint,
            pull_timeout_s=600.0,
        )

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            silent = time.monotonic() - self._last_heard
            if silent > self._dead_after_s:
                self._stop(f"the coordinator was silent for {silent:.0f} s")
                return

    def _stop(self, reason: str, ended: bool = False) -> None:
        if self._done.is_set():
            return
        self._reason, self._ended = reason, ended
        log.info("shard %d stops: %s", self.index, reason)
        if self.service is not None:
            self.service.stop(reason)
        self._done.set()

    def request_stop(self) -> None:
        """Stop now (signals call this)."""
        self._stop("interrupted")

    async def dispatch(self, request: Request, message: Message) -> None:
        """Serve workers' chunks and pulls, and the coordinator's commands."""
        service = self.service
        assert service is not None
        if isinstance(message, GradientChunk):
            stagetrace.mark("s_chunk_in", task=message.task_id, offset=message.offset)
            await service.on_gradient_chunk(request.identity, request.request_id, message)
            stagetrace.mark("s_chunk_staged", task=message.task_id, offset=message.offset)
            return
        if isinstance(message, PullRequest):
            await service.on_pull(request.identity, request.request_id, message)
            return
        key = getattr(message, "key", None)
        if not (isinstance(key, str) and key.isascii() and hmac.compare_digest(key, self.key)):
            raise ProtocolError(ErrorCode.UNKNOWN_WORKER, "control requests need the shard key")
        self._last_heard = time.monotonic()
        stagetrace.mark(
            "s_" + message.TYPE, version=service.version, task=getattr(message, "task_id", None)
        )
        reply: Message
        if isinstance(message, StagedRequest):
            report = await service.staged(message.task_id, message.worker_id, message.timeout_s)
            reply = StagedReply(
                finite=report.finite,
                grad_sq=report.grad_sq if report.finite else 0.0,
                buffer_sq=report.buffer_sq if report.finite else 0.0,
            )
        elif isinstance(message, PrepareRequest):
            ok, reason = await service.prepare(
                message.version,
                message.task_ids,
                message.weights,
                message.lr_scale,
                message.buffer_scale,
            )
            reply = PrepareReply(ok=ok, reason=reason)
        elif isinstance(message, PublishRequest):
            await service.publish(message.version)
            reply = AckReply()
        elif isinstance(message, AbortRequest):
            await service.abort(message.version, message.code, message.message)
            reply = AckReply()
        elif isinstance(message, DropRequest):
            await service.drop(message.task_ids, message.code, message.message)
            reply = AckReply()
        elif isinstance(message, CaptureRequest):
            captured = await service.capture(message.with_slots)
            reply = StateReply(
                version=captured.version,
                optimizer_steps=captured.optimizer_steps,
                slots=captured.slots,
                state=captured.state,
                slot_state=captured.slot_state.reshape(-1),
            )
        elif isinstance(message, PingRequest):
            reply = PingReply(version=service.version, staged=len(service.store.staged))
        elif isinstance(message, ShutdownRequest):
            self.endpoint.reply(request.identity, request.request_id, AckReply())
            self._stop(f"the coordinator ended the run: {message.reason}", ended=True)
            return
        else:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unexpected {message.TYPE}")
        self.endpoint.reply(request.identity, request.request_id, reply)
        stagetrace.mark(
            "s_" + message.TYPE + "_done",
            version=service.version,
            task=getattr(message, "task_id", None),
        )

    async def close(self) -> None:
        """Cancel outstanding work and close the socket."""
        await self.owner.cancel_all()
        self.endpoint.close()


async def serve_shard(config: ShardConfig) -> tuple[str, bool]:
    """Run one shard until the run ends; returns why it stopped and whether the coordinator
    ended the run.

    Raises:
        PSError: registration failed.
    """
    import signal

    shard = ShardServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shard.request_stop)
    try:
        return await shard.run()
    except RemoteError as exc:
        raise PSError(f"the coordinator refused this shard: {exc}") from None
    finally:
        await shard.close()
