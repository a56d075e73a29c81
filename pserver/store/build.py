"""The server's parameter stores: its own slice store with ``--shards 1``, else K shard links."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from common.protocol.chunks import shard_bounds
from pserver.config import ServerConfig
from pserver.optimizer import FlatOptimizer
from pserver.store.service import StoreService
from pserver.store.slices import SliceStore
from pserver.store.stores import LocalStores, RemoteStores

if TYPE_CHECKING:
    from pserver.server import ParameterServer


def make_optimizer(config: ServerConfig) -> FlatOptimizer:
    """The run's optimizer (for one slice of the parameters)."""
    return FlatOptimizer(
        config.optimizer, config.lr, config.momentum, config.nesterov, config.weight_decay
    )


def build_stores(ps: ParameterServer) -> LocalStores | RemoteStores:
    """The stores of ``ps``, starting from ``ps.initial`` (the initial or resumed state)."""
    cfg, initial = ps.config, ps.initial
    if cfg.shards > 1:
        return RemoteStores(
            shard_bounds(ps.state_size, cfg.shards),
            ps.shard_key,
            cfg.shard_timeout_s,
            ps.num_params,
            make_optimizer(cfg).slots,
        )
    store = SliceStore(
        0,
        ps.state_size,
        ps.num_params,
        torch.from_numpy(initial.state.astype(np.float32)),
        make_optimizer(cfg),
        ps.nonneg,
        ps.chunk_elems,
        initial.version,
    )
    if initial.slots:
        store.load_slots(
            initial.slots, torch.from_numpy(initial.slot_state), initial.optimizer_steps
        )
    return LocalStores(
        StoreService(store, cfg.wire_dtype, ps.store_tokens, ps.endpoint, cfg.stage_timeout_s)
    )
