"""Server-side optimizers on one flat parameter vector, writing each step to a new tensor.

Writing the result to fresh memory (copy-on-step) keeps every published parameter snapshot
immutable without an extra copy, and lets a rejected update leave the parameters untouched.
"""

from __future__ import annotations

import math

import torch

from common.errors import ConfigError


class FlatOptimizer:
    """SGD (momentum, Nesterov) or Adam with L2 weight decay, as ``torch.optim`` defines them.

    Args:
        kind: ``sgd`` or ``adam``.
        lr: base learning rate.
        momentum: SGD momentum (ignored by Adam).
        nesterov: Nesterov momentum for SGD.
        weight_decay: L2 penalty added to the gradient.
        betas, eps: Adam's constants.
    """

    def __init__(
        self,
        kind: str,
        lr: float,
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

    def step(
        self, params: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr_scale: float = 1.0
    ) -> None:
        """Write ``params`` updated by ``grad`` into ``out``; ``params`` is not modified.

        Args:
            params: current flat parameters.
            grad: flat gradient of the same length (not modified).
            out: destination, distinct from ``params``.
            lr_scale: factor on the learning rate for this step (schedule x staleness).
        """
        lr = self.lr * lr_scale
        self.steps += 1
        if self.weight_decay:
            grad = torch.add(grad, params, alpha=self.weight_decay, out=self._scratch(params))
        if self.kind == "sgd":
            self._sgd(params, grad, out, lr)
        else:
            self._adam(params, grad, out, lr)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A persistent temporary: fresh 47 MB allocations cost more than the arithmetic."""
        scratch = self.state.get("scratch")
        if scratch is None or scratch.shape != like.shape:
            scratch = self.state["scratch"] = torch.empty_like(like)
        return scratch

    def _sgd(self, params: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr: float) -> None:
        direction = grad
        if self.momentum:
            buf = self.state.get("momentum")
            if buf is None:
                buf = self.state["momentum"] = grad.clone()
            else:
                torch.add(grad, buf, alpha=self.momentum, out=buf)  # one pass: m*buf + g
            direction = buf
            if self.nesterov:
                direction = torch.add(grad, buf, alpha=self.momentum, out=self._scratch(params))
        torch.add(params, direction, alpha=-lr, out=out)

    def _adam(self, params: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr: float) -> None:
        beta1, beta2 = self.betas
        if "exp_avg" not in self.state:
            self.state["exp_avg"] = torch.zeros_like(params)
            self.state["exp_avg_sq"] = torch.zeros_like(params)
        exp_avg, exp_avg_sq = self.state["exp_avg"], self.state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1 = 1 - beta1**self.steps
        bias2 = 1 - beta2**self.steps
        denom = torch.sqrt(exp_avg_sq, out=self._scratch(params))
        denom.div_(math.sqrt(bias2)).add_(self.eps)
        torch.addcdiv(params, exp_avg, denom, value=-lr / bias1, out=out)


def lr_factor(schedule: str, progress: float, warmup_fraction: float = 0.0) -> float:
    """The schedule's factor on the base learning rate.

    Args:
        schedule: ``constant``, ``cosine`` (to zero at the end) or ``step`` (x0.1 at 50 % and
            75 % of training).
        progress: fraction of training done, in [0, 1].
        warmup_fraction: linear warm-up over this first fraction of training.

    Returns:
        The factor in [0, 1].
    """
    progress = min(max(progress, 0.0), 1.0)
    if warmup_fraction > 0 and progress < warmup_fraction:
        return max(progress / warmup_fraction, 1e-3)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    return 1.0
