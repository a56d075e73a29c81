"""One flat float32 vector for a model's parameters and float buffers, and views into it."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class FlatLayout:
    """Where each parameter and float buffer of a model sits in the flat state vector.

    The vector is ``[parameters..., float buffers...]``; integer buffers (such as
    BatchNorm's ``num_batches_tracked``) stay local to each process.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters()]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.num_params = sum(p.numel() for p in self.params)
        self.num_buffers = sum(b.numel() for b in self.buffers)

    @property
    def size(self) -> int:
        """Length of the flat state vector."""
        return self.num_params + self.num_buffers

    def read_state(self) -> torch.Tensor:
        """Copy parameters and float buffers into a new flat CPU float32 tensor."""
        parts = [t.detach().reshape(-1).float().cpu() for t in (*self.params, *self.buffers)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def read_buffers(self) -> torch.Tensor:
        """Copy only the float buffers into a new flat CPU float32 tensor."""
        parts = [b.detach().reshape(-1).float().cpu() for b in self.buffers]
        return torch.cat(parts) if parts else torch.zeros(0)

    def write_state(self, flat: torch.Tensor | np.ndarray) -> None:
        """Load a flat state vector into the model (on whatever device it lives).

        Raises:
            ValueError: ``flat`` has the wrong length.
        """
        flat = torch.as_tensor(flat)
        if flat.numel() != self.size:
            raise ValueError(f"state has {flat.numel()} values, the model needs {self.size}")
        offset = 0
        with torch.no_grad():
            for t in (*self.params, *self.buffers):
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t), non_blocking=True)
                offset += n

    def read_push(self, buffers_before: torch.Tensor) -> torch.Tensor:
        """Flat ``[gradients..., buffer changes...]`` after a backward pass.

        Args:
            buffers_before: the float buffers as they were when the step started.

        Returns:
            A new flat CPU float32 tensor; parameters without a gradient contribute zeros.
        """
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
            for p in self.params
        ]
        parts = [g.cpu() for g in grads]
        parts.append(self.read_buffers() - buffers_before)
        return torch.cat(parts)
