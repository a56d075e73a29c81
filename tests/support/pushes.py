"""A reference for what a worker pushes, computed from the model's own tensors."""

from __future__ import annotations

import torch

from common.training.flat import FlatLayout


def push_of(layout: FlatLayout, state_before: torch.Tensor) -> torch.Tensor:
    """Flat ``[gradients..., buffer changes...]`` after a backward pass.

    Args:
        layout: the model's flat layout.
        state_before: the flat state (``layout.read_state()``) when the step started.

    Returns:
        A new flat CPU float32 tensor; parameters without a gradient contribute zeros.
    """
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
        for p in layout.params
    ]
    changes = layout.read_state()[layout.num_params :] - state_before[layout.num_params :]
    return torch.cat([*grads, changes])
