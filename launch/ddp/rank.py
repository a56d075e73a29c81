"""One rank of the DDP baseline: ``python -m launch.ddp.rank --config FILE --rank R``."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import inspect
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from common.data.dataset import DatasetReader
from common.errors import PSError
from common.logsetup import setup_logging
from common.protocol.ending import FinishReason
from common.training.device import resolve_device
from common.training.evaluator import Evaluator
from common.training.flat import FlatLayout
from common.training.models import build_model
from common.training.planner import plan_batches, plan_equal, tail_scale
from common.training.schedule import lr_factor, progress
from launch.ddp import checkpoint
from launch.ddp.config import DDPConfig
from launch.ddp.record import RunRecorder
from launch.ddp.step import ComputeOnlyStep
from pserver import checkpoint as checkpoint_file

log = logging.getLogger(__name__)

PROBE_PASSES = 5  # timed passes per rank that measure its speed for weighted DDP's shares


class Collective:
    """The few collectives a rank needs; a world of one needs none (the reference run)."""

    def __init__(self, rank: int, world_size: int, *, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over all ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def decide(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank."""
        if self.world_size == 1:
            return flag
        box = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.broadcast(box, src=0)
        return bool(box.item())

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.world_size > 1:
            self.all_reduce(torch.zeros(1, device=self.device))


def _optimizer(model: nn.Module, config: DDPConfig) -> torch.optim.Optimizer:
    """SGD or Adam with L2 weight decay, as the server's ``FlatOptimizer`` defines them."""
    t = config.train
    if t.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(
        model.parameters(),
        lr=t.lr,
        momentum=t.momentum,
        nesterov=t.nesterov,
        weight_decay=t.weight_decay,
    )


def bf16_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``bf16_compress_hook`` under another name: DDP refuses that name unless NCCL
    runs it, yet the hook itself (cast to bfloat16, all-reduce, cast back) works on gloo."""
    return default_hooks.bf16_compress_hook(state, bucket)  # type: ignore[arg-type]


# DDP checks the hook's annotations as objects, not as the strings this module's are.
bf16_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _wrap_ddp(model: nn.Module, device: torch.device, compression: str = "none") -> nn.Module:
    """``DistributedDataParallel`` that never syncs buffers in forward (steps average them);
    with ``compression="bf16"`` its reducer all-reduces gradients through ``bf16_hook``."""
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        wrapped = ddp(model, device_ids=ids, forward_sync_buffers=False)
    else:
        wrapped = ddp(model, device_ids=ids, broadcast_buffers=False)
    if compression == "bf16":
        wrapped.register_comm_hook(None, bf16_hook)
    return wrapped


class RankTrainer:
    """Trains one rank's replica over seeded epoch permutations cut into global batches, each
    split into local batches: equal ones, or (weighted DDP) in proportion to the ranks' speeds.

    Args:
        config: the run's configuration.
        rank: this process's rank.
        collective: the communication between ranks.
    """

    def __init__(self, config: DDPConfig, rank: int, *, collective: Collective) -> None:
        self.config, self.rank, self.collective = config, rank, collective
        self.world_size = config.world_size
        self.device = collective.device
        torch.set_num_threads(config.threads)
        self.reader = DatasetReader(config.dataset, cache_bytes=config.cache_mb << 20)
        meta = self.reader.meta
        channels, height, _ = meta.shape
        torch.manual_seed(config.train.seed)  # the parameter server's initialisation
        self.model = build_model(config.model, channels, meta.num_classes, height)
        self.model.to(self.device).train()
        forward: nn.Module = self.model
        if self.world_size > 1:
            forward = _wrap_ddp(self.model, self.device, config.grad_compression)
        self.step_fn = ComputeOnlyStep(
            self.model,
            forward,
            rank=rank,
            world_size=self.world_size,
            device=self.device,
            schedule=config.schedule_of(rank),
            all_reduce=collective.all_reduce,
            grads_in_backward=self.world_size > 1 and config.grad_compression != "none",
        )
        self.optimizer = _optimizer(self.model, config)
        self.layout = FlatLayout(self.model)
        self.recorder: RunRecorder | None = None
        if rank == 0:
            evaluator = Evaluator(
                build_model(config.model, channels, meta.num_classes, height),
                self.reader,
                num_classes=meta.num_classes,
                batch=config.eval_batch,
            )
            self.recorder = RunRecorder(config, evaluator, layout=self.layout)
        self.steps = self.samples = 0
        self.epoch, self.cursor = 1, 0  # the epoch in progress and its samples done
        self.stopping = False  # a signal asked to stop: every rank stops after the next step
        if config.resume:
            self._resume()
        self.sizes: list[int] = []  # weighted DDP: every rank's part of a full global batch
        self.speeds: list[float] = []
        self.work = [0.0] * self.world_size  # this epoch's samples and emulated seconds
        self.seconds = [0.0] * self.world_size

    def _resume(self) -> None:
        """Continue from the run's newest checkpoint: state, optimizer, position, record."""
        saved = checkpoint_file.read_newest(self.config.run_dir / checkpoint.DIRECTORY)
        if self.recorder is not None:
            self.recorder.restore(saved.meta)  # first: it refuses another run's checkpoint
        checkpoint.restore(saved, self.layout, self.optimizer)
        meta = saved.meta
        self.steps, self.samples = int(meta["version"]), int(meta["samples"])
        self.epoch, self.cursor = int(meta["epoch"]), int(meta["cursor"])
        log.info("resumed at step %d (epoch %d, sample %d)", self.steps, self.epoch, self.cursor)

    def run(self) -> None:
        """Train until the epochs, the step limit, the target accuracy or a signal say stop;
        checkpoint every ``checkpoint_every`` epochs and when stopped by a signal."""
        cfg = self.config.train
        train_idx = self.reader.train_indices
        count = len(train_idx)
        self._warm_up()
        self.collective.barrier()
        if self.recorder is not None:
            self.recorder.train_started()
        if not self.config.resume:
            self._checkpoint()  # a group that fails before an epoch ends restarts from here
        reason: FinishReason | None = None
        if cfg.max_steps is not None and self.steps >= cfg.max_steps:
            reason = FinishReason.MAX_STEPS  # resumed where it had ended
        elif self.cursor == count and cfg.epochs is not None and self.epoch >= cfg.epochs:
            reason = FinishReason.EPOCHS
        while reason is None:
            if self.cursor == count:  # the epoch is done
                self.epoch, self.cursor = self.epoch + 1, 0
                if self.config.rebalance == "epoch":
                    self._rebalance()
            epoch = self.epoch
            perm = np.random.default_rng(cfg.seed + epoch).permutation(count)
            while self.cursor < count and reason is None:
                indices = train_idx[perm[self.cursor : self.cursor + cfg.global_batch]]
                stop = self._step(epoch, indices)
                self.cursor += len(indices)
                if cfg.max_steps is not None and self.steps >= cfg.max_steps:
                    reason = FinishReason.MAX_STEPS
                elif stop:
                    reason = FinishReason.INTERRUPTED
            if reason is not None:
                break
            reached = False
            if self.recorder is not None:
                reached = self.recorder.epoch_done(epoch, self.steps, self.samples)
            if self.collective.decide(reached):
                reason = FinishReason.TARGET_OA
            elif cfg.epochs is not None and epoch >= cfg.epochs:
                reason = FinishReason.EPOCHS
            if epoch % self.config.checkpoint_every == 0:
                self._checkpoint()
        if reason is FinishReason.INTERRUPTED:
            self._checkpoint()
        if self.recorder is not None:
            self.recorder.finish(reason, self.epoch, self.steps, self.samples)
        self.collective.barrier()  # leave together: a rank exiting early breaks gloo's teardown

    def _checkpoint(self) -> None:
        if self.recorder is not None:  # every replica holds the same state: rank 0 writes it
            position = (self.epoch, self.cursor, self.steps, self.samples)
            self.recorder.checkpoint(*position, self.optimizer)

    def _split(self, batch: int) -> list[int]:
        """Every rank's part of a global batch of ``batch`` samples: equal parts, or
        (weighted) the parts of a full batch scaled to ``batch`` by largest remainder."""
        if not self.config.weighted:
            sizes = plan_equal(list(range(self.world_size)), batch)
        elif batch == sum(self.sizes):
            return self.sizes
        else:
            shares = {r: float(b) for r, b in enumerate(self.sizes) if b}
            sizes = plan_batches(shares, batch, every_worker=False)
        return [sizes.get(r, 0) for r in range(self.world_size)]

    def _set_speeds(self, speeds: list[float], source: str) -> None:
        """Weighted DDP: split the global batch in proportion to ``speeds`` (a rank may get 0)."""
        self.speeds = speeds
        total = min(self.config.train.global_batch, len(self.reader.train_indices))
        shares = {r: s for r, s in enumerate(speeds) if s > 0}
        planned = plan_batches(shares, total, every_worker=False)
        self.sizes = [planned.get(r, 0) for r in range(self.world_size)]
        log.info("shares (%s): local batches %s", source, self.sizes)
        if self.recorder is not None:
            self.recorder.shares(self.sizes, speeds, source)

    def _rebalance(self) -> None:
        """Re-split by the speeds the last epoch's steps measured (samples over emulated
        compute seconds; a rank that computed nothing keeps its last speed). Every rank
        holds the same timings (the step's all-reduce gave them), so all agree."""
        speeds = [
            work / seconds if seconds > 0 else old
            for work, seconds, old in zip(self.work, self.seconds, self.speeds, strict=True)
        ]
        self.work, self.seconds = [0.0] * self.world_size, [0.0] * self.world_size
        self._set_speeds(speeds, "epoch")

    def _warm_up(self) -> None:
        """Load the data cache, run untimed passes and calibrate the compute time of each
        local batch size this rank will see (ranks take turns), so start-up stays off the
        clock."""
        self.reader.read(self.reader.train_indices[:1])
        meta = self.reader.meta
        count, batch = len(self.reader.train_indices), self.config.train.global_batch
        gen = torch.Generator().manual_seed(self.rank)
        full = min(batch, count)
        x = torch.randn(full, *meta.shape, generator=gen).to(self.device)
        y = torch.randint(0, meta.num_classes, (full,), generator=gen).to(self.device)
        if self.config.weighted:
            if self.config.shares:
                self._set_speeds(list(self.config.shares), "given")
            else:
                self._set_speeds(self._probe(x, y), "probe")
        sizes = {self._split(full)[self.rank]}
        if count % batch:
            sizes.add(self._split(count % batch)[self.rank])
        local = max(max(sizes), 1)
        if not self.step_fn.schedule.slows:
            sizes = set()  # nothing to calibrate: a rank that is not slowed never sleeps
        calibrated: dict[int, float] = {}
        for turn in range(self.world_size):
            if turn == self.rank:
                calibrated = self.step_fn.warm_up(x[:local], y[:local], sizes=sizes)
            self.collective.barrier()  # one rank at a time: the others do not share its cores
        log.info(
            "calibrated compute per local batch: %s",
            ", ".join(f"{b}: {1000 * t:.2f} ms" for b, t in sorted(calibrated.items())),
        )

    def _probe(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """Every rank's samples per second at the same probe batch (the equal share of B),
        timed on all ranks at once and gathered with one all-reduce."""
        size = -(-len(y) // self.world_size)
        self.step_fn.warm_up(x[:size], y[:size])  # untimed passes first
        self.collective.barrier()
        speeds = torch.zeros(self.world_size, device=self.device)
        speeds[self.rank] = size / self.step_fn.probe_s(x[:size], y[:size], PROBE_PASSES)
        self.collective.all_reduce(speeds)
        return [float(s) for s in speeds.tolist()]

    def _step(self, epoch: int, indices: np.ndarray) -> bool:
        """One step over the global batch ``indices``; returns whether a rank asked to stop."""
        begin = time.perf_counter()
        batches = self._split(len(indices))
        offset, size = sum(batches[: self.rank]), batches[self.rank]
        mine = indices[offset : offset + size]
        x_np, y_np = self.reader.read(mine)
        x = torch.from_numpy(np.ascontiguousarray(x_np)).to(self.device)
        y = torch.from_numpy(np.ascontiguousarray(y_np)).to(self.device)
        t = self.config.train
        weight = size / len(indices) if self.config.weighted else None
        scale = tail_scale(len(indices), t.global_batch)
        result = self.step_fn.run(self.steps, x, y, scale, weight, self.stopping)
        for r, b in enumerate(batches):
            if b:
                self.work[r] += b
                self.seconds[r] += result.emulated_s[r]
        count = len(self.reader.train_indices)
        done = progress(self.steps, self.samples, count, t.max_steps, t.epochs)
        factor = lr_factor(t.lr_schedule, done, t.warmup_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * factor
        self.optimizer.step()
        self.step_fn.sleep()
        self.steps += 1
        self.samples += len(indices)
        if self.recorder is not None:
            self.recorder.round(epoch, self.steps, batches, result, time.perf_counter() - begin)
            self.recorder.snapshot(epoch, self.steps, self.samples)
        return result.stop

    def close(self) -> None:
        """Release the dataset, the run log and the DDP wrapper."""
        if self.recorder is not None:
            self.recorder.close()
        self.reader.close()
        del self.step_fn  # holds the DistributedDataParallel wrapper


def run_rank(
    config: DDPConfig, rank: int, store_address: str | None, host_store: bool = False
) -> None:
    """Join the process group (when there are several ranks), train, and leave.

    Args:
        config: the run's configuration.
        rank: this process's rank.
        store_address: ``HOST:PORT`` of the launcher's TCPStore (None for a single rank).
        host_store: rank 0 binds the store at ``store_address`` itself (the launcher cannot
            reach the ranks' emulated hosts).
    """
    device = resolve_device(config.device_of(rank))
    if config.world_size > 1:
        if store_address is None:
            raise SystemExit("--store is required when there are several ranks")
        host, _, port = store_address.rpartition(":")
        master = host_store and rank == 0
        store = dist.TCPStore(
            host,
            int(port),
            config.world_size if master else None,
            master,
            timeout=datetime.timedelta(seconds=config.startup_timeout_s),
            wait_for_workers=False,
        )
        dist.init_process_group(
            config.resolved_backend(),
            store=store,
            rank=rank,
            world_size=config.world_size,
            timeout=datetime.timedelta(seconds=config.collective_timeout_s),
        )
    trainer = None
    try:
        trainer = active = RankTrainer(
            config, rank, collective=Collective(rank, config.world_size, device=device)
        )

        def stop(_signum: int, _frame: FrameType | None) -> None:
            active.stopping = True  # every rank ends after the same step (the step's tail)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
        trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
            trainer = None  # the DDP wrapper goes before its process group
        if dist.is_initialized():
            dist.destroy_process_group()
            log.debug("left the process group")


def main(argv: list[str] | None = None) -> int:
    """The rank process's entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="ddp_config.json")
    parser.add_argument("--rank", type=int, required=True, help="this process's rank")
    parser.add_argument("--store", default=None, help="HOST:PORT of the rendezvous store")
    parser.add_argument("--host-store", action="store_true", help="rank 0 binds the store")
    args = parser.parse_args(argv)
    config = DDPConfig.from_json(args.config.read_text(encoding="utf-8"))
    setup_logging("INFO", f"ddp[{args.rank}] ")
    faulthandler.enable()  # a crash in torch's C++ code still shows where Python was
    try:
        run_rank(config, args.rank, args.store, args.host_store)
    except PSError as exc:  # e.g. a device this machine lacks: one line, not a traceback
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    if config.world_size > 1:
        exit_without_teardown()
    return 0


def exit_without_teardown() -> None:
    """Exit with status 0 once a process group is destroyed, skipping the interpreter's final
    C++ teardown: in about one run in fifteen a torch/gloo thread aborts it ("terminate called
    without an active exception", no Python frame) although everything is closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
