"""The coordinator's side of parameter shards: a shard says hello, proves it holds the run's
shard secret, and is given its range."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import zmq.asyncio

from common.errors import ErrorCode, ProtocolError
from common.protocol.aclient import AsyncConnection
from common.protocol.security import check_hello_proof, server_as_client
from common.protocol.shard_messages import CONTROL_REPLIES, ShardHello, ShardWelcome
from common.training.runlog import RunLog
from pserver.config import ENDPOINT_SCHEMES, ServerConfig
from pserver.runstate import RunState
from pserver.store.service import Replier
from pserver.store.stores import CapturedState, RemoteStores, ShardLink
from pserver.transport import Request

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardTerms:
    """What every shard is welcomed with, apart from its range.

    Attributes:
        shard_key: the key the shards' control requests carry.
        store_token_key: the key shards check workers' store tokens with.
        initial: the state (and optimizer slots) the run starts from.
        nonneg: flat ranges that must stay non-negative.
        chunk_elems: elements per wire chunk.
    """

    shard_key: str
    store_token_key: str
    initial: CapturedState
    nonneg: list[int]
    chunk_elems: int


class ShardRegistry:
    """Registers a run's K parameter shards.

    Args:
        config: the server configuration (optimizer, wire format, timeouts, CURVE secret).
        stores: the shard links, filled as shards register.
        secret: the run's shard secret, which a hello must prove.
        terms: what every shard is welcomed with.
        zmq_context: the ZeroMQ context to connect to shards with.
        run: the run (no shard registers after training ended).
        log: the run log (``shard`` events).
        replier: answers the hellos (the server's endpoint).
    """

    def __init__(
        self,
        config: ServerConfig,
        stores: RemoteStores,
        *,
        secret: bytes,
        terms: ShardTerms,
        zmq_context: zmq.asyncio.Context,
        run: RunState,
        log: RunLog,
        replier: Replier,
    ) -> None:
        self.config, self.stores, self.secret = config, stores, secret
        self.shard_key, self.store_token_key = terms.shard_key, terms.store_token_key
        self.initial, self.nonneg, self.chunk_elems = terms.initial, terms.nonneg, terms.chunk_elems
        self.context, self.run, self.log, self.replier = zmq_context, run, log, replier

    async def register(self, request: Request, msg: ShardHello) -> None:
        """Give a shard server the next free range of the state and connect to it.

        Raises:
            ProtocolError: the hello does not prove the shard secret, all ranges are taken,
                or the address is bad.
        """
        stores = self.stores
        if not check_hello_proof(self.secret, msg.address, msg.name, msg.proof):
            log.warning(
                "refused a shard hello from %r: it does not prove the shard secret", msg.name
            )
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                "shard_hello does not prove the run's shard secret (give the coordinator's "
                "--shard-secret-file as --secret-file, or its CURVE key)",
            )
        if len(stores.links) >= stores.expected or self.run.finished:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"all {stores.expected} shards are registered already"
            )
        if not msg.address.startswith(ENDPOINT_SCHEMES) or msg.address.endswith((":0", ":*")):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"shard address {msg.address!r} is not usable")
        cfg = self.config
        index = len(stores.links)
        lo, hi = stores.bounds[index], stores.bounds[index + 1]
        num_params = stores.num_params
        split = min(max(num_params - lo, 0), hi - lo)
        initial = self.initial
        slots = initial.slots
        rows = (
            initial.slot_state[:, lo : lo + split].astype(np.float32)
            if slots
            else np.zeros((0, split), dtype=np.float32)
        )
        curve = None if cfg.curve_secret is None else server_as_client(cfg.curve_secret)
        welcome = ShardWelcome(
            index=index,
            key=self.shard_key,
            store_token_key=self.store_token_key,
            lo=lo,
            hi=hi,
            num_params=num_params,
            wire_dtype=cfg.wire_dtype,
            chunk_elems=self.chunk_elems,
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
            version=initial.version,
            optimizer_steps=initial.optimizer_steps,
            dead_after_s=max(cfg.dead_after_s, cfg.shard_timeout_s) * 2,
            nonneg_bounds=self.nonneg,
            slots=list(slots),
            state=initial.state[lo:hi].astype(np.float32),
            slot_state=rows.reshape(-1),
        )
        connection = AsyncConnection(
            self.context, msg.address, replies=CONTROL_REPLIES, curve=curve
        )
        connection.start()
        stores.add(ShardLink(index, msg.address, lo, hi, connection))
        self.log.event("shard", index=index, address=msg.address, lo=lo, hi=hi, host=msg.name[:64])
        log.info("shard %d (%s) serves state [%d, %d) at %s", index, msg.name, lo, hi, msg.address)
        self.replier.reply(request.identity, request.request_id, welcome)
