"""The coordinator's side of parameter shards: a shard says hello, proves it holds the run's
shard secret, and is given its range."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from common.errors import ErrorCode, ProtocolError
from common.protocol.aclient import AsyncConnection
from common.protocol.security import check_hello_proof, server_as_client
from common.protocol.shard_messages import CONTROL_REPLIES, ShardHello, ShardWelcome
from pserver.config import ENDPOINT_SCHEMES
from pserver.store.stores import RemoteStores, ShardLink
from pserver.transport import Request

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger(__name__)


async def register_shard(ps: ParameterServer, request: Request, msg: ShardHello) -> None:
    """Give a shard server the next free range of the state and connect to it.

    Raises:
        ProtocolError: the run has no shards, the hello does not prove the shard secret, all
            ranges are taken, or the address is bad.
    """
    stores = ps.stores
    if not isinstance(stores, RemoteStores) or ps.shard_secret is None:
        raise ProtocolError(ErrorCode.BAD_FIELD, "this server was not started with --shards K > 1")
    if not check_hello_proof(ps.shard_secret, msg.address, msg.name, msg.proof):
        log.warning("refused a shard hello from %r: it does not prove the shard secret", msg.name)
        raise ProtocolError(
            ErrorCode.UNAUTHORIZED,
            "shard_hello does not prove the run's shard secret (give the coordinator's "
            "--shard-secret-file as --secret-file, or its CURVE key)",
        )
    if len(stores.links) >= stores.expected or ps.finished:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"all {stores.expected} shards are registered already"
        )
    if not msg.address.startswith(ENDPOINT_SCHEMES) or msg.address.endswith((":0", ":*")):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"shard address {msg.address!r} is not usable")
    cfg = ps.config
    index = len(stores.links)
    lo, hi = stores.bounds[index], stores.bounds[index + 1]
    split = min(max(ps.num_params - lo, 0), hi - lo)
    initial = ps.initial
    slots = initial.slots
    rows = (
        initial.slot_state[:, lo : lo + split].astype(np.float32)
        if slots
        else np.zeros((0, split), dtype=np.float32)
    )
    curve = None if cfg.curve_secret is None else server_as_client(cfg.curve_secret)
    welcome = ShardWelcome(
        index=index,
        key=ps.shard_key,
        store_token_key=ps.store_tokens.key,
        lo=lo,
        hi=hi,
        num_params=ps.num_params,
        wire_dtype=cfg.wire_dtype,
        chunk_elems=ps.chunk_elems,
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        version=initial.version,
        optimizer_steps=initial.optimizer_steps,
        dead_after_s=max(cfg.dead_after_s, cfg.shard_timeout_s) * 2,
        nonneg_bounds=ps.nonneg,
        slots=list(slots),
        state=initial.state[lo:hi].astype(np.float32),
        slot_state=rows.reshape(-1),
    )
    connection = AsyncConnection(ps.endpoint.context, msg.address, CONTROL_REPLIES, curve)
    connection.start()
    stores.add(ShardLink(index, msg.address, lo, hi, connection))
    ps.log.event("shard", index=index, address=msg.address, lo=lo, hi=hi, host=msg.name[:64])
    log.info("shard %d (%s) serves state [%d, %d) at %s", index, msg.name, lo, hi, msg.address)
    ps.endpoint.reply(request.identity, request.request_id, welcome)
