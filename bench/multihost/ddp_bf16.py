"""A DDP rank whose gradients cross the wire as bfloat16, for the multi-host training bench.

Runs ``launch.ddp.rank`` unchanged except for its step's all-reduce: the gradient part of the
flat tensor (``launch.ddp.step``) is cast to bfloat16, all-reduced, and cast back; the float
buffers and the step's tail (timings, loss, sample counts) go in a second, fp32 all-reduce of a
few thousand values. That is what PyTorch's ``bf16_compress_hook`` does to DDP's buckets, on the
tensor this loop actually sends: its step all-reduces one flat tensor itself after a backward
under ``no_sync`` (so a hook registered on the DDP wrapper would never run), and PyTorch's
hook is refused outside NCCL on CUDA anyway. Started by ``run_ddp(...,
rank_module="bench.multihost.ddp_bf16")``; takes ``launch.ddp.rank``'s arguments.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from launch.ddp import rank
from launch.ddp.step import ComputeOnlyStep


class Bf16Step(ComputeOnlyStep):
    """``ComputeOnlyStep`` whose all-reduce sends the gradients as bfloat16."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        plain, grads = self.all_reduce, self.num_params

        def all_reduce(flat: torch.Tensor) -> None:
            if flat.numel() <= grads:  # not the step's flat tensor
                plain(flat)
                return
            compressed = flat[:grads].to(torch.bfloat16)
            plain(compressed)
            plain(flat[grads:])
            flat[:grads].copy_(compressed)

        self.all_reduce = all_reduce


rank.ComputeOnlyStep = Bf16Step  # type: ignore[misc]

if __name__ == "__main__":
    sys.exit(rank.main())
