"""One gloo rank of the multi-host bench's DDP baseline (run inside a worker namespace).

Measures, on the dataset's local copy: one step's compute on its own (ranks take turns, so no
two ranks share the CPU while timing), the flat all-reduce of the model's gradient (every rank
at once, the time of the slowest rank per repeat), and whole DDP training steps. Rank 0 prints
one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from common.data.dataset import DatasetReader
from common.logsetup import setup_logging
from common.training.models import build_model

log = logging.getLogger(__name__)


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _compute(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward and backward on one batch (what a PS worker times as compute); its seconds."""
    start = time.perf_counter()
    model.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(x), y).backward()
    return time.perf_counter() - start


def solo_compute(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """Each rank in turn times ``steps`` steps after one warm-up step while the others wait.

    Returns:
        Every rank's step times, rank after rank (the same list on every rank).
    """
    world = dist.get_world_size()
    times = torch.zeros(world, steps, dtype=torch.float64)
    for turn in range(world):
        dist.barrier()
        if turn == dist.get_rank():
            _compute(model, x, y)
            times[turn] = torch.tensor([_compute(model, x, y) for _ in range(steps)])
        dist.barrier()
    dist.all_reduce(times)  # only the owner's row is non-zero
    return times.flatten().tolist()


def flat_allreduce(count: int, repeats: int) -> list[float]:
    """Time ``repeats`` all-reduces of ``count`` float32 values after one warm-up.

    Returns:
        Per repeat, the slowest rank's seconds.
    """
    flat = torch.ones(count, dtype=torch.float32)
    dist.all_reduce(flat)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        times.append(_slowest(time.perf_counter() - start))
    return times


def ddp_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """Time whole DDP steps (forward, backward with all-reduce, SGD step) after one warm-up.

    Returns:
        Per step, the slowest rank's seconds.
    """
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if step:
            times.append(_slowest(time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> int:
    """Run one rank; rank 0 prints ``RESULT {json}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="rank 0's address")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=8, help="local batch per rank")
    parser.add_argument("--compute-steps", type=int, default=5)
    parser.add_argument("--allreduce-repeats", type=int, default=5)
    parser.add_argument("--ddp-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    args = parser.parse_args(argv)
    setup_logging("INFO", f"gloo[{args.rank}] ")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        with DatasetReader(args.dataset) as reader:
            c, h, _ = reader.meta.shape
            train = reader.train_indices
            picked = train[args.rank * args.batch : (args.rank + 1) * args.batch]
            x_np, y_np = reader.read(picked)
            model = build_model(args.model, c, reader.meta.num_classes, h)
        x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
        params = sum(p.numel() for p in model.parameters())
        state = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
        log.info("model %s: %d parameters, batch %d", args.model, params, len(y))
        compute = solo_compute(model, x, y, args.compute_steps)
        allreduce = flat_allreduce(params, args.allreduce_repeats)
        steps = ddp_steps(model, x, y, args.ddp_steps)
        if args.rank == 0:
            result = {
                "params": params,
                "state_floats": state,
                "batch": len(y),
                "compute_s": compute,
                "allreduce_s": allreduce,
                "ddp_step_s": steps,
            }
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
