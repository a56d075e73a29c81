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


def nonnegative_bounds(model: nn.Module, layout: FlatLayout) -> list[int]:
    """Flat ranges of the state that must never become negative (BatchNorm running variances).

    Returns:
        ``[start0, stop0, start1, stop1, ...]`` offsets into the flat state.
    """
    bounds: list[int] = []
    offset = layout.num_params
    for name, buffer in model.named_buffers():
        if not buffer.is_floating_point():
            continue
        if name.endswith("running_var"):
            bounds += [offset, offset + buffer.numel()]
        offset += buffer.numel()
    return bounds


class FlatModel:
    """A model whose parameters, float buffers and gradients are views of flat buffers on its
    device, so loading parameters is one copy in and reading the push is one copy out.

    Build it after the model is on its device and never move the model afterwards.

    Args:
        model: the model (its tensors are re-pointed into the flat buffers).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        layout = FlatLayout(model)
        self.num_params, self.size = layout.num_params, layout.size
        first = next(iter(layout.params), None)
        device = first.device if first is not None else torch.device("cpu")
        self.state = layout.read_state().to(device)
        self.grads = torch.zeros(self.size, device=device)  # the tail: buffer changes
        self._buffers_before = torch.empty(self.size - self.num_params, device=device)
        offset = 0
        with torch.no_grad():
            for param in layout.params:
                n = param.numel()
                param.data = self.state[offset : offset + n].view_as(param)
                param.grad = self.grads[offset : offset + n].view_as(param)
                offset += n
            for name, buffer in list(model.named_buffers()):
                if not buffer.is_floating_point():
                    continue
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                n = buffer.numel()
                module._buffers[attr] = self.state[offset : offset + n].view_as(buffer)
                offset += n

    def load(self, host_state: torch.Tensor | None) -> None:
        """Copy a flat host state in (non-blocking from pinned memory; None: it was written
        into ``state`` itself) and remember the buffers as loaded, for their change over the
        step."""
        if host_state is not None:
            self.state.copy_(host_state, non_blocking=True)
        self._buffers_before.copy_(self.state[self.num_params :])

    def reset_buffers(self) -> None:
        """Set the float buffers back to their loaded values: a step changes nothing else."""
        self.state[self.num_params :].copy_(self._buffers_before)

    def zero_grad(self) -> None:
        """Zero every gradient (in place, so they stay views)."""
        self.grads.zero_()

    def push_vector(self) -> torch.Tensor:
        """``[gradients..., buffer changes...]`` without a copy: the gradient buffer itself,
        its tail set to the buffer changes; valid until the next ``zero_grad``."""
        p = self.num_params
        torch.sub(self.state[p:], self._buffers_before, out=self.grads[p:])
        return self.grads

    def push_into(self, host: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Write ``[gradients..., buffer changes...]`` (elements ``start`` to ``stop`` of it)
        into the same range of the flat host buffer ``host``."""
        p = self.num_params
        stop = self.size if stop is None else stop
        if start < p:
            cut = min(stop, p)
            host[start:cut].copy_(self.grads[start:cut], non_blocking=True)
        if stop > p:
            cut = max(start, p)
            change = self.state[cut:stop] - self._buffers_before[cut - p : stop - p]
            host[cut:stop].copy_(change, non_blocking=True)
        if self.state.device.type == "cuda":
            torch.cuda.current_stream(self.state.device).synchronize()
