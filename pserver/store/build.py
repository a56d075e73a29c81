"""The server's parameter stores: its own slice store with ``--shards 1``, else K shard links."""

from __future__ import annotations

import numpy as np
import torch

from common.protocol.chunks import shard_bounds
from common.protocol.shard_messages import ShardWelcome
from common.protocol.tokens import TokenBook
from pserver.config import ServerConfig
from pserver.store.optimizer import FlatOptimizer
from pserver.store.service import CapturedState, Replier, StoreService
from pserver.store.slices import SliceStore
from pserver.store.stores import ParameterStores, RemoteStores


def make_optimizer(config: ServerConfig | ShardWelcome) -> FlatOptimizer:
    """The run's optimizer (for one slice of the parameters), as the server's configuration or
    a shard's welcome sets it."""
    return FlatOptimizer(
        config.optimizer,
        config.lr,
        momentum=config.momentum,
        nesterov=config.nesterov,
        weight_decay=config.weight_decay,
    )


def build_stores(
    config: ServerConfig,
    initial: CapturedState,
    num_params: int,
    nonneg: list[int],
    chunk_elems: int,
    shard_key: str,
    store_tokens: TokenBook,
    replier: Replier,
) -> tuple[ParameterStores, RemoteStores | None]:
    """The stores of a run, starting from ``initial`` (the initial or resumed state).

    Args:
        config: the server configuration (shards, optimizer, wire format, timeouts).
        initial: the state (and optimizer slots) the run starts from.
        num_params: the parameters at the start of the flat state.
        nonneg: flat ranges that must stay non-negative (``SliceStore``).
        chunk_elems: elements per wire chunk.
        shard_key: the key the shards' control requests carry.
        store_tokens: checks the tokens of workers' chunks and pulls (``--shards 1``).
        replier: answers workers' chunks and pulls (``--shards 1``: the server's endpoint).

    Returns:
        The stores, and the links to K shards that shard hellos fill (None with
        ``--shards 1``, where the stores are the server's own store service).
    """
    state_size = len(initial.state)
    if config.shards > 1:
        remote = RemoteStores(
            shard_bounds(state_size, config.shards),
            shard_key,
            timeout_s=config.shard_timeout_s,
            num_params=num_params,
            slots=make_optimizer(config).slots,
        )
        return remote, remote
    store = SliceStore(
        0,
        state_size,
        num_params=num_params,
        state=torch.from_numpy(initial.state.astype(np.float32)),
        optimizer=make_optimizer(config),
        nonneg_bounds=nonneg,
        chunk_elems=chunk_elems,
        version=initial.version,
    )
    if initial.slots:
        store.load_slots(
            initial.slots, torch.from_numpy(initial.slot_state), initial.optimizer_steps
        )
    service = StoreService(
        store,
        config.wire_dtype,
        tokens=store_tokens,
        replier=replier,
        pull_timeout_s=config.stage_timeout_s,
    )
    return service, None
