"""One DDP training step whose emulated slowdown scales compute time only.

Why not let DDP's backward all-reduce the gradients: that backward also waits for the slowest
rank, so a rank that measured it and slept (F-1) times as long would be emulating its wait, not
its compute. Its next step ends later, the others wait longer, and with two slowed ranks each
one's wait grows the other's: the step time feeds back without bound. So a step here is

1. forward and backward under ``ddp_model.no_sync()`` (no communication), timed with a
   device synchronisation on both ends: the compute time t;
2. one flat ``all_reduce`` (SUM) of ``[gradients, buffer changes, tail]``, then division by the
   number of ranks that had samples: the plain mean of the ranks' mean gradients, exactly
   what equal-sync computes (an epoch's last, short step of b samples is then weighted by
   b / B, as the parameter server weighs it); the tail carries each rank's compute and
   emulated time, its loss and whether it was asked to stop, so rank 0 learns every rank's
   speed, and all ranks stop after the same step, without another collective;
3. after the optimizer step, ``sleep``: (F-1)·t̂, so this rank looks F times slower, where t̂
   is this rank's compute time for its local batch size calibrated before training (the
   fastest of several passes before the clock starts, ``warm_up``; ranks take turns). A fixed
   t̂ keeps the noise of each step's t (a busy core, a cache evicted during the sleep) out of
   the sleep, which would otherwise multiply it by F-1 on the slowest rank and so on every
   rank's step. The sleep comes after the step, as in a plain DDP loop whose slow ranks
   sleep after each step: the faster ranks then compute while a slow one sleeps and the
   slow one computes while they wait, where sleeping before the all-reduce made every rank
   compute at once and, on a machine whose ranks share cores, slowed the compute on the
   critical path (pslaunch ddp took 1.12-1.19x the plain loop's step time that way).

Weighted DDP (``run``'s ``weight``): rank r's loss is scaled by its share w_r = b_r / b of the
step's b samples (times the number of ranks when the reducer's hook divides by it, so the weight
is applied before the bf16 cast), its buffer changes by w_r, and the sum over ranks is the
update: sum_r (b_r / b) g_r, the gradient of the whole step, scaled by b / B on an epoch's tail.

With a gradient compression hook (``pslaunch ddp --grad-compression bf16``) the gradients go
through DDP's own reducer and its hook during backward instead, as a plain DDP loop with that
hook sends them, and step 2 sums only the rest; the measured t then includes that all-reduce,
while the sleep still uses the calibrated compute-only t̂.

Only the compute and the sleep are ever scaled, so a rank's emulated time is t + (F-1)·t̂
whatever the others do, and the step time is max_r(t_r + (F_r-1)·t̂_r) plus the all-reduce.
Float buffers (BatchNorm running statistics) are averaged the same way, as the parameter server
averages their changes; integer buffers stay local, as they do on parameter-server workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from common.training.device import synchronize
from common.training.slowdown import SlowdownSchedule

AllReduce = Callable[[torch.Tensor], None]
CALIBRATION_PASSES = 16
CALIBRATION_BUDGET_S = 2.0  # per batch size: a large model calibrates on fewer passes


def calibrated_time(times: list[float]) -> float:
    """The compute time t̂ that passes ``times`` calibrate: the fastest.

    A core shared with other processes (other ranks, other jobs) only ever adds time to a
    pass, so the fastest pass estimates the device's own compute time and stays put under
    load, where a median or a quartile moves with the machine's load and the sleep would
    multiply that by F-1.
    """
    return min(times)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step did on every rank (identical on all ranks after the all-reduce).

    Attributes:
        loss: mean training loss over the ranks that had samples, weighted by their samples.
        compute_s: per rank, the measured compute time t_r.
        emulated_s: per rank, the emulated compute time t_r + (F_r-1)·t̂_r.
        active: how many ranks had samples.
        stop: some rank asked to stop after this step (``run``'s ``stop``).
    """

    loss: float
    compute_s: tuple[float, ...]
    emulated_s: tuple[float, ...]
    active: int
    stop: bool = False


class ComputeOnlyStep:
    """Forward/backward without communication, then one flat all-reduce; the emulated slowdown
    is slept by ``sleep``, which the caller calls after its optimizer step.

    Args:
        model: the module whose parameters and buffers are trained (not the DDP wrapper).
        forward: the module to call for the forward pass (the DDP wrapper when distributed).
        rank, world_size: this process's rank and the number of ranks.
        device: where the model lives.
        schedule: this rank's slowdown schedule.
        all_reduce: sums a tensor over all ranks in place (not called when world_size is 1).
        grads_in_backward: the gradients are all-reduced by ``forward``'s reducer (and its
            communication hook) during backward, which leaves their mean over all ranks;
            ``all_reduce`` then sums only the buffers and the tail.
    """

    def __init__(
        self,
        model: nn.Module,
        forward: nn.Module,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        schedule: SlowdownSchedule,
        all_reduce: AllReduce,
        grads_in_backward: bool = False,
    ) -> None:
        self.model, self.forward = model, forward
        self.grads_in_backward = grads_in_backward
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.schedule = schedule
        self.all_reduce = all_reduce
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.num_params = sum(q.numel() for q in self.params)
        self.num_buffers = sum(b.numel() for b in self.buffers)
        self.calibrated: dict[int, float] = {}
        self._pause_s = 0.0  # the last step's emulated slowdown, slept by ``sleep``
        # [gradients (p), buffer changes (b), active, loss sum, samples, stop, t_r (w),
        # F_r·t_r (w)]:
        # what one all-reduce sums. The gradients are views into it (backward accumulates
        # there), so a step copies no gradient before or after its all-reduce.
        self.flat = torch.zeros(self.num_params + self.num_buffers + 4 + 2 * world_size)
        self.flat = self.flat.to(device)
        with torch.no_grad():
            offset = 0
            for q in self.params:
                view = self.flat[offset : offset + q.numel()].view_as(q)
                if q.grad is not None:
                    view.copy_(q.grad)
                q.grad = view
                offset += q.numel()

    def _no_sync(self) -> contextlib.AbstractContextManager[object]:
        no_sync = getattr(self.forward, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _compute(
        self, x: torch.Tensor, y: torch.Tensor, sync: bool = False, factor: float = 1.0
    ) -> tuple[float, float]:
        """Forward and backward of ``factor`` times the mean loss, with no communication
        unless ``sync`` (then the reducer all-reduces the gradients); returns (mean loss,
        seconds). An empty batch gives zero gradients (a rank with no samples still joins the
        reducer's all-reduce)."""
        synchronize(self.device)
        start = time.perf_counter()
        with contextlib.nullcontext() if sync else self._no_sync():
            self.model.zero_grad(set_to_none=False)
            logits = self.forward(x)
            loss = nn.functional.cross_entropy(logits, y, reduction="sum") / max(len(y), 1)
            (loss * factor if factor != 1.0 else loss).backward()
        synchronize(self.device)
        return float(loss.detach()), time.perf_counter() - start

    @contextlib.contextmanager
    def _kept(self) -> Iterator[None]:
        """Passes within the block leave parameters, buffers and gradients as they were."""
        before = self._flat(self.buffers)
        yield
        self.model.zero_grad(set_to_none=False)
        self._write_buffers(before)

    def warm_up(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        repeats: int = 2,
        sizes: Iterable[int] = (),
        passes: int = CALIBRATION_PASSES,
    ) -> dict[int, float]:
        """Untimed passes, then calibrate the compute time t̂ of each local batch size.

        Leaves parameters, buffers and gradients as they were; nothing is communicated.

        Args:
            x, y: a batch at least as large as the largest size (random data will do).
            repeats: how many passes before calibrating.
            sizes: the local batch sizes the rank will train on (sizes above ``len(y)`` or
                below 1 are skipped; a size never calibrated sleeps on its measured t).
            passes: timed passes per size (fewer once a size has taken
                ``CALIBRATION_BUDGET_S``, at least 3); t̂ is the fastest (``calibrated_time``).

        Returns:
            ``self.calibrated``: local batch size -> t̂ in seconds.
        """
        with self._kept():
            for _ in range(repeats):
                self._compute(x, y)
            for size in sorted(set(sizes)):
                if 1 <= size <= len(y):
                    times: list[float] = []
                    while len(times) < max(passes, 1) and (
                        len(times) < 3 or sum(times) < CALIBRATION_BUDGET_S
                    ):
                        times.append(self._compute(x[:size], y[:size])[1])
                    self.calibrated[size] = calibrated_time(times)
        return self.calibrated

    def probe_s(self, x: torch.Tensor, y: torch.Tensor, passes: int) -> float:
        """The emulated time of one pass over ``(x, y)`` at step 0: the mean compute time t of
        ``passes`` passes (a mean, not the fastest: under a CPU quota the first pass after
        an idle spell runs at full speed) plus the slowdown's (F-1)·t. Leaves the model as it
        was; nothing is communicated."""
        with self._kept():
            mean = sum(self._compute(x, y)[1] for _ in range(passes)) / passes
        return mean + self.schedule.wait_s(0, mean)

    def run(
        self,
        step: int,
        x: torch.Tensor,
        y: torch.Tensor,
        scale: float = 1.0,
        weight: float | None = None,
        stop: bool = False,
    ) -> StepResult:
        """Compute this rank's gradients on ``(x, y)`` and combine them over the ranks.

        Afterwards every parameter's ``.grad`` holds ``scale`` times the combination (the mean
        over ranks with samples, or with ``weight`` the weighted sum) and the float buffers
        have moved by ``scale`` times the same combination of their changes; the caller
        applies the optimizer.

        Args:
            step: the step number (0-based) that selects the slowdown factor.
            x, y: this rank's local batch on ``self.device``; may be empty.
            scale: the step's weight, b / B for an epoch's tail of b samples
                (``common.training.planner.tail_scale``), as the parameter server weighs it.
            weight: weighted DDP: this rank's share of the step's samples (the shares of all
                ranks sum to 1); None: the plain mean.
            stop: this rank asks every rank to stop after this step (it was interrupted).

        Returns:
            The step's loss and per-rank timings.
        """
        p, b, w = self.num_params, self.num_buffers, self.world_size
        head = p + b
        flat = self.flat
        before = self._flat(self.buffers)
        samples = len(y)
        loss, compute, emulated = 0.0, 0.0, 0.0
        factor = 1.0 if weight is None else weight * (w if self.grads_in_backward else 1)
        self._pause_s = 0.0
        if self.grads_in_backward:  # every rank joins the reducer, also with no samples
            loss, compute = self._compute(x, y, True, factor)  # flat[:p]: mean over all ranks
        elif samples:
            loss, compute = self._compute(x, y, False, factor)  # zeroes, then fills, flat[:p]
        else:
            flat[:p].zero_()
        if samples:
            self._pause_s = self.schedule.wait_s(step, self.calibrated.get(samples, compute))
            emulated = compute + self._pause_s
        else:
            compute = 0.0
        flat[p:].zero_()
        if samples:
            torch.sub(self._flat(self.buffers), before, out=flat[p:head])
            if weight is not None:
                flat[p:head].mul_(weight)
            flat[head : head + 3] = torch.tensor([1.0, loss * samples, float(samples)])
        flat[head + 3] = float(stop)
        flat[head + 4 + self.rank] = compute
        flat[head + 4 + w + self.rank] = emulated
        if w > 1:
            self.all_reduce(flat[p:] if self.grads_in_backward else flat)
        active, loss_sum, total, stops, *times = flat[head:].tolist()
        if weight is not None:  # already the weighted sum
            flat[:head].mul_(scale)
        elif self.grads_in_backward:  # the reducer's mean is over every rank
            flat[:p].mul_(scale * w / max(active, 1.0))
            flat[p:head].mul_(scale / max(active, 1.0))
        else:
            flat[:head].mul_(scale / max(active, 1.0))  # the gradients' mean, in place
        self._write_buffers(before + flat[p:head])
        return StepResult(
            loss=loss_sum / max(total, 1.0),
            compute_s=tuple(times[:w]),
            emulated_s=tuple(times[w:]),
            active=round(active),
            stop=stops > 0,
        )

    def _write_buffers(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for buf in self.buffers:
                buf.copy_(values[offset : offset + buf.numel()].view_as(buf))
                offset += buf.numel()

    def sleep(self) -> None:
        """The emulated slowdown of the last ``run``: sleep (F-1)·t̂ (call after the
        optimizer step)."""
        if self._pause_s > 0:
            time.sleep(self._pause_s)
        self._pause_s = 0.0

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, device=self.device)
        return torch.cat([t.detach().reshape(-1).float() for t in tensors])
