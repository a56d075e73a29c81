"""Server-side optimizers on a flat parameter vector, copy-on-step for parameters and state.

A step is computed into fresh memory (``prepare``) and only becomes the optimizer's state when
it is published, so an update that turns out invalid (non-finite parameters) is discarded
without a trace, and published parameter snapshots are never modified.
"""

from __future__ import annotations

import math

import torch

from common.errors import ConfigError

SLOTS = {"sgd": ("momentum",), "sgd-plain": (), "adam": ("exp_avg", "exp_avg_sq")}
# Slots whose non-finite values may leave the stepped parameters finite (they divide the step)
UNSEEN = {"adam": ("exp_avg_sq",)}


class FlatOptimizer:
    """SGD (momentum, Nesterov) or Adam with L2 weight decay, as ``torch.optim`` defines them.

    State slots start at zero (for SGD momentum that equals torch's first-step ``buf = grad``
    bit for bit). ``state`` holds the published slots; ``prepare`` writes a candidate into a
    second set of buffers and ``publish`` swaps them in.

    Args:
        kind: ``sgd`` or ``adam``.
        lr: base learning rate.
        momentum: SGD momentum (ignored by Adam).
        nesterov: Nesterov momentum for SGD.
        weight_decay: L2 penalty added to the gradient.
        betas, eps: Adam's constants.

    Raises:
        ConfigError: unknown kind, or Nesterov without momentum.
    """

    def __init__(
        self,
        kind: str,
        lr: float,
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if kind not in ("sgd", "adam"):
            raise ConfigError(f"unknown optimizer {kind!r}")
        if nesterov and momentum <= 0:
            raise ConfigError("Nesterov momentum needs --momentum > 0")
        self.kind, self.lr, self.momentum, self.nesterov = kind, lr, momentum, nesterov
        self.weight_decay, self.betas, self.eps = weight_decay, betas, eps
        self.steps = 0
        self.state: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._scratch: torch.Tensor | None = None

    @property
    def slots(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors."""
        if self.kind == "adam":
            return SLOTS["adam"]
        return SLOTS["sgd"] if self.momentum else SLOTS["sgd-plain"]

    def _buffers(
        self, like: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        for name in self.slots:
            if name not in self.state or self.state[name].shape != like.shape:
                self.state[name] = torch.zeros_like(like)
            if name not in self._spare or self._spare[name].shape != like.shape:
                self._spare[name] = torch.empty_like(like)
        return self.state, self._spare

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A persistent temporary: fresh 47 MB allocations cost more than the arithmetic."""
        if self._scratch is None or self._scratch.shape != like.shape:
            self._scratch = torch.empty_like(like)
        return self._scratch

    def prepare(
        self,
        params: torch.Tensor,
        grad: torch.Tensor,
        out: torch.Tensor,
        lr_scale: float = 1.0,
        window: tuple[int, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Write ``params`` updated by ``grad`` into ``out``; nothing else changes.

        A step may be computed window by window (element-wise arithmetic: the result is the
        same bit for bit); the candidate state is complete once every window was prepared.

        Args:
            params: current flat parameters (not modified).
            grad: the gradient of the window (not modified).
            out: destination of the whole vector, distinct from ``params`` and ``grad``.
            lr_scale: factor on the learning rate for this step (schedule x staleness).
            window: ``(lo, hi)``, the part of the vector to compute (default: all of it).

        Returns:
            The candidate optimizer state, to pass to ``publish`` (or drop).
        """
        lr = self.lr * lr_scale
        full_old, full_new = self._buffers(params)
        p, o, old, new, scratch = params, out, full_old, full_new, self.scratch(params)
        if window is not None and window != (0, params.numel()):  # views cost more than 1 µs
            lo, hi = window
            p, o, scratch = params[lo:hi], out[lo:hi], scratch[lo:hi]
            old = {k: v[lo:hi] for k, v in full_old.items()}
            new = {k: v[lo:hi] for k, v in full_new.items()}
        if self.weight_decay:
            grad = torch.add(grad, p, alpha=self.weight_decay, out=scratch)
        if self.kind == "sgd":
            direction = grad
            if self.momentum:
                torch.add(grad, old["momentum"], alpha=self.momentum, out=new["momentum"])
                direction = new["momentum"]
                if self.nesterov:
                    direction = torch.add(grad, direction, alpha=self.momentum, out=scratch)
            torch.add(p, direction, alpha=-lr, out=o)
            return full_new
        beta1, beta2 = self.betas
        torch.lerp(old["exp_avg"], grad, 1 - beta1, out=new["exp_avg"])
        torch.mul(old["exp_avg_sq"], beta2, out=new["exp_avg_sq"])
        new["exp_avg_sq"].addcmul_(grad, grad, value=1 - beta2)
        step = self.steps + 1
        bias1 = 1 - beta1**step
        bias2 = 1 - beta2**step
        denom = torch.sqrt(new["exp_avg_sq"], out=scratch)
        denom.div_(math.sqrt(bias2)).add_(self.eps)
        torch.addcdiv(p, new["exp_avg"], denom, value=-lr / bias1, out=o)
        return full_new

    def publish(self, candidate: dict[str, torch.Tensor]) -> None:
        """Make a prepared step's state the optimizer's state."""
        if candidate is not self._spare:
            raise ValueError("publish takes the state the last prepare returned")
        self.state, self._spare = candidate, self.state
        self.steps += 1
