"""The parameters, optimizer and update bookkeeping behind every mode policy."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from common.errors import ConfigError, ErrorCode, ProtocolError
from pserver.config import ServerConfig
from pserver.optimizer import FlatOptimizer, lr_factor
from pserver.sampler import EpochSampler

_T = TypeVar("_T")


class Snapshot(NamedTuple):
    """An immutable published state and its version."""

    version: int
    state: torch.Tensor


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A read-only float32 tensor sharing ``array``'s memory (it is never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable buffer: we only read it
        return torch.from_numpy(array)


def check_finite(vector: torch.Tensor, what: str) -> None:
    """Raise NON_FINITE if ``vector`` has a NaN or Inf (one pass, no temporary)."""
    if not torch.isfinite(vector.sum()):
        raise ProtocolError(ErrorCode.NON_FINITE, f"{what} contains NaN or Inf")


class BufferPool:
    """Recycles state buffers once nothing refers to them any more.

    A snapshot stays referenced while it is the current state, while a reply that carries it
    is still being sent (ZeroMQ holds zero-copy frames until they are on the wire) and while
    it is being evaluated. Fresh 47 MB allocations cost more than the update itself (page
    faults on first touch), so buffers whose only owner is the pool are reused.

    Args:
        numel: float32 values per buffer.
        keep: how many buffers the pool owns at most; beyond that, allocations are not kept.
    """

    _FREE_REFCOUNT = 3  # the pool's list, the loop variable and getrefcount's argument

    def __init__(self, numel: int, keep: int = 4) -> None:
        self.numel, self.keep = numel, keep
        self._buffers: list[np.ndarray] = []

    def acquire(self) -> torch.Tensor:
        """A float32 tensor of ``numel`` values that no one else refers to."""
        for buf in self._buffers:
            if sys.getrefcount(buf) == self._FREE_REFCOUNT:
                return torch.from_numpy(buf)
        buf = np.empty(self.numel, dtype=np.float32)
        if len(self._buffers) < self.keep:
            self._buffers.append(buf)
        return torch.from_numpy(buf)


class Trainer:
    """Owns the flat state ``[parameters..., float buffers...]`` and applies updates to it.

    Every update runs on one dedicated thread, so updates are ordered and the event loop never
    blocks on tensor arithmetic. Each update writes a new state tensor: ``state`` is an
    immutable snapshot that replies may send without copying.

    Args:
        config: the server configuration.
        initial_state: the model's initial flat state.
        num_params: how many leading entries are parameters (the rest are float buffers).
        train_count: size of the training split.
    """

    def __init__(
        self, config: ServerConfig, initial_state: torch.Tensor, num_params: int, train_count: int
    ) -> None:
        self.config = config
        self.snapshot = Snapshot(0, initial_state.contiguous())
        self.num_params = num_params
        self.steps = 0
        self.samples_applied = 0
        self.optimizer = FlatOptimizer(
            config.optimizer, config.lr, config.momentum, config.nesterov, config.weight_decay
        )
        self.sampler = EpochSampler(train_count, config.seed, config.epochs)
        self.train_count = train_count
        self._pool = BufferPool(initial_state.numel())
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="update")

    @property
    def state_size(self) -> int:
        """Length of the flat state."""
        return self.snapshot.state.numel()

    @property
    def version(self) -> int:
        """Number of updates applied so far."""
        return self.snapshot.version

    def progress(self) -> float:
        """Fraction of training done, for the learning-rate schedule."""
        if self.config.max_steps is not None:
            return self.steps / self.config.max_steps
        if self.config.epochs is not None:
            return self.samples_applied / (self.config.epochs * self.train_count)
        return 0.0

    def current_lr_factor(self) -> float:
        """The schedule's factor for the next update."""
        return lr_factor(self.config.lr_schedule, self.progress(), self.config.warmup_fraction)

    async def _run(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def accumulate(self, total: torch.Tensor, push: torch.Tensor, weight: float) -> None:
        """``total += weight * push`` after checking ``push`` is finite.

        Raises:
            ProtocolError: NON_FINITE; ``total`` is then unchanged.
        """

        def work() -> None:
            check_finite(push, "pushed gradient")
            total.add_(push, alpha=weight)

        await self._run(work)

    async def apply(
        self,
        update: torch.Tensor,
        samples: int,
        buffer_scale: float,
        based_on: int | None = None,
        lr_scale_for: Callable[[int], float] = lambda tau: 1.0,
    ) -> int:
        """Apply one optimizer step with ``update = [gradient..., buffer change...]``.

        Args:
            update: flat gradient followed by the float buffers' change.
            samples: how many training samples the update covers.
            buffer_scale: factor on the buffer change.
            based_on: the version the update was computed on (None: the current one).
            lr_scale_for: factor on the scheduled learning rate given the staleness tau,
                evaluated when the update runs; may raise ``ProtocolError`` to reject it.

        Returns:
            The staleness tau = (version before this step) - ``based_on``.

        Raises:
            ProtocolError: NON_FINITE or a rejection by ``lr_scale_for``; the state is then
                unchanged.
        """
        p = self.num_params

        def work() -> int:
            version, old = self.snapshot
            tau = 0 if based_on is None else version - based_on
            lr = lr_scale_for(tau) * self.current_lr_factor()
            check_finite(update, "pushed gradient")
            new = self._pool.acquire()
            self.optimizer.step(old[:p], update[:p], new[:p], lr)
            torch.add(old[p:], update[p:], alpha=buffer_scale, out=new[p:])
            self.steps += 1
            self.samples_applied += samples
            self.snapshot = Snapshot(version + 1, new)  # one atomic swap: replies never mix
            return tau

        return await self._run(work)

    async def capture(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """A consistent copy of the state, optimizer and counters, taken between updates.

        Returns:
            Arrays (``state``, ``opt/<name>``) and counters (``version``, ``steps``, ...).
        """

        def work() -> tuple[dict[str, np.ndarray], dict[str, int]]:
            version, state = self.snapshot
            arrays = {"state": state.numpy()}  # immutable snapshot: no copy needed
            for name, tensor in self.optimizer.state.items():
                if name != "scratch":
                    arrays[f"opt/{name}"] = tensor.numpy().copy()
            counters = {
                "version": version,
                "steps": self.steps,
                "samples_applied": self.samples_applied,
                "optimizer_steps": self.optimizer.steps,
            }
            return arrays, counters

        return await self._run(work)

    def restore(self, arrays: dict[str, np.ndarray], counters: dict[str, int]) -> None:
        """Load what ``capture`` returned (before serving).

        Raises:
            ConfigError: the saved state has another size than this model's.
        """
        state = torch.from_numpy(arrays["state"].astype(np.float32))
        if state.numel() != self.state_size:
            raise ConfigError(
                f"the checkpoint holds {state.numel()} values, this model "
                f"{self.state_size}: same --model and dataset?"
            )
        self.snapshot = Snapshot(int(counters["version"]), state)
        self.steps = int(counters["steps"])
        self.samples_applied = int(counters["samples_applied"])
        self.optimizer.steps = int(counters["optimizer_steps"])
        self.optimizer.state = {
            key.removeprefix("opt/"): torch.from_numpy(value.astype(np.float32))
            for key, value in arrays.items()
            if key.startswith("opt/")
        }

    def close(self) -> None:
        """Stop the update thread."""
        self._executor.shutdown(wait=True, cancel_futures=True)
