"""``pslaunch ddp --grad-compression bf16``: PyTorch's bf16 compression hook on DDP's reducer,
in a real two-rank gloo group."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from common.training.slowdown import SlowdownSchedule
from launch.ddp.launcher import DDPConfig
from launch.ddp.rank import _wrap_ddp, exit_without_teardown
from launch.ddp.step import ComputeOnlyStep


def _rank(rank: int, store_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        results = {c: _step(rank, c) for c in ("none", "bf16")}
        results.update({f"{c}-weighted": _step(rank, c, weighted=True) for c in ("none", "bf16")})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def _step(rank: int, compression: str, weighted: bool = False) -> dict[str, object]:
    """One step of the same model and data with the given compression; rank's gradients
    (``weighted``: weighted DDP, rank 0 computing 6 of the 8 samples and rank 1 two)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    forward = _wrap_ddp(model, torch.device("cpu"), compression)

    def all_reduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    step = ComputeOnlyStep(
        model,
        forward,
        rank=rank,
        world_size=2,
        device=torch.device("cpu"),
        schedule=SlowdownSchedule(1.0),
        all_reduce=all_reduce,
        grads_in_backward=compression != "none",
    )
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 16, generator=generator) * (1 + rank)
    y = torch.randint(0, 3, (8,), generator=generator)
    size = (6, 2)[rank] if weighted else len(y)
    result = step.run(0, x[:size], y[:size], weight=size / 8 if weighted else None)
    grads = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
    return {"grads": grads, "active": result.active}


def test_bf16_hook_sends_bfloat16_gradients_on_gloo(tmp_path: Path) -> None:
    out = tmp_path / "grads.pt"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    exact, bf16 = results["none"], results["bf16"]
    full, rounded = exact["grads"], bf16["grads"]
    assert exact["active"] == bf16["active"] == 2
    # With the hook every mean gradient is a bfloat16 value (summed as bfloat16, cast back);
    # the fp32 mean is not ...
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)
    assert not torch.equal(full.to(torch.bfloat16).float(), full)
    # ... and differs from it only by bfloat16's rounding.
    torch.testing.assert_close(rounded, full, rtol=2e-2, atol=1e-3)
    # Weighted DDP applies each rank's weight before the cast: the sum of the weighted
    # bfloat16 gradients is the fp32 weighted sum up to bfloat16's rounding, not the plain mean.
    weighted, weighted_bf16 = results["none-weighted"]["grads"], results["bf16-weighted"]["grads"]
    assert torch.equal(weighted_bf16.to(torch.bfloat16).float(), weighted_bf16)
    torch.testing.assert_close(weighted_bf16, weighted, rtol=2e-2, atol=1e-3)
    assert not torch.allclose(weighted, full, rtol=0.1, atol=1e-2)


def test_config_round_trips_grad_compression(tmp_path: Path) -> None:
    config = DDPConfig(tmp_path / "d.h5", "hsi-cnn", (1.0, 1.0), tmp_path, grad_compression="bf16")
    assert DDPConfig.from_json(config.to_json()).grad_compression == "bf16"
