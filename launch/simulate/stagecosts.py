"""The CPU cost of each stage of a sharded round, measured on this machine with the server's
and the worker's own code: a shard staging pushed pieces (``SliceStore.stage``), its update
from one and from several gradients (``SliceStore.prepare`` and ``publish``, SGD with momentum
as ``pserver start`` runs it), the wire pieces of a new version (``encode``), and a worker
taking pulled parameters into its model (``as_tensor``, ``decode_into``, ``FlatModel.load``)
and turning its gradient into pieces (``encode``). One thread, as the server, shards and
workers run torch; each stage's fastest of ``repeats`` runs (the machine's other jobs only
ever add to it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common.protocol.chunks import as_tensor, chunk_elems_for, decode_into, encode, shard_bounds
from common.training.flat import FlatModel
from launch.simulate.spec import FP32_BYTES, WIRE_BYTES, ServerCosts
from pserver.config import ServerConfig
from pserver.store.build import make_optimizer
from pserver.store.slices import SliceStore


def _fastest(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_stage_costs(
    model_params: int, shards: int, members: int, wire: str, repeats: int = 5
) -> ServerCosts:
    """Per-byte CPU rates of a round's stages for one layout, as ``ServerCosts``.

    Args:
        model_params: elements of the flat state.
        shards: K (the slice measured is one shard's, 1/K of the state).
        members: gradients per round (at least 2: the sum's rate is the difference between
            an update from ``members`` gradients and one from a single gradient).
        wire: ``fp32``, ``bf16`` or ``fp16``.
        repeats: runs per stage; the fastest counts.

    Returns:
        The rates; ``step_s`` is 0 (its fixed part is inside the per-byte rate).

    Raises:
        ValueError: ``members`` below 2 or an unknown wire dtype.
    """
    if members < 2 or wire not in WIRE_BYTES:
        raise ValueError(f"need members >= 2 and a wire dtype in {list(WIRE_BYTES)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(model_params, shards, members, wire, repeats)
    finally:
        torch.set_num_threads(threads)


def _measure(model_params: int, shards: int, members: int, wire: str, repeats: int) -> ServerCosts:
    config = ServerConfig(dataset=Path(), model="", epochs=1)  # the defaults of pserver start
    generator = torch.Generator().manual_seed(0)
    bounds = shard_bounds(model_params, shards)
    lo, hi = bounds[0], bounds[1]
    store = SliceStore(
        lo,
        hi,
        num_params=model_params,
        state=torch.randn(hi - lo, generator=generator),
        optimizer=make_optimizer(config),
        nonneg_bounds=[],
        chunk_elems=chunk_elems_for(config.chunk_bytes, wire),
    )
    gradients = [
        encode(torch.randn(model_params, generator=generator) * 1e-3, wire)[0]
        for _ in range(members)
    ]
    task = [0]

    def stage(count: int) -> list[int]:
        first = task[0]
        task[0] += count
        for j in range(count):
            for start, stop in store.spans:
                data = as_tensor(gradients[j][start:stop], wire, "gradient")
                store.stage(first + j, j, store.version, start, 1.0, data)
        return list(range(first, first + count))

    def update(ids: list[int]) -> None:
        version = store.version + 1
        ok, reason = store.prepare(version, ids, [1.0 / len(ids)] * len(ids), 1.0, 1.0)
        if not ok:
            raise RuntimeError(f"measuring an update failed: {reason}")
        store.publish(version)

    stage_s = update_one = update_all = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ids = stage(members)
        stage_s = min(stage_s, time.perf_counter() - start)
        start = time.perf_counter()
        update(ids)
        update_all = min(update_all, time.perf_counter() - start)
        ids = stage(1)
        start = time.perf_counter()
        update(ids)
        update_one = min(update_one, time.perf_counter() - start)
    reply_s = _fastest(
        lambda: [encode(store.state[a - lo : b - lo], wire) for a, b in store.spans], repeats
    )
    model = torch.randn(model_params, generator=generator)
    into = torch.empty(model_params)
    pulled = encode(model, wire)
    worker_encode_s = _fastest(lambda: encode(model, wire), repeats)
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.zeros(model_params))
    flat = FlatModel(holder)

    def take_in() -> None:
        decode_into(as_tensor(pulled[0], wire, "params"), pulled[1], into)
        flat.load(into)

    worker_decode_s = _fastest(take_in, repeats)
    slice_bytes = (hi - lo) * FP32_BYTES
    wire_piece = (hi - lo) * WIRE_BYTES[wire]
    return ServerCosts(
        step_s_per_byte=update_one / slice_bytes,
        decode_s_per_byte=stage_s / (members * wire_piece),
        sum_s_per_byte=max(update_all - update_one, 0.0) / ((members - 1) * slice_bytes),
        encode_s_per_byte=reply_s / slice_bytes,
        worker_decode_s_per_byte=worker_decode_s / (model_params * WIRE_BYTES[wire]),
        worker_encode_s_per_byte=worker_encode_s / (model_params * FP32_BYTES),
    )
