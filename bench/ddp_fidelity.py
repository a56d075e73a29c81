"""Is ``pslaunch ddp`` as fast as a plain DistributedDataParallel loop on the same job?

``plain`` is the reference written here: one process per rank, the training split in memory,
``DistributedDataParallel``, no metrics; a rank with slowdown F sleeps (F-1)·t after each step,
t its calibrated compute time (as ``pslaunch ddp`` calibrates). ``pslaunch`` is
``launch.ddp.run_ddp`` on the same job. Both run interleaved within each repeat.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from bench import ROOT
from bench.harness.jasper import jasper, jasper_missing
from bench.harness.record import parse_settings
from common.data.dataset import DatasetReader
from common.logsetup import setup_logging
from common.procs import Children
from common.training.models import build_model
from common.training.planner import plan_equal
from launch.ddp.launcher import DDPConfig, run_ddp
from launch.settings import TrainSettings
from pserver.history import read_history

CALIBRATION_PASSES = 16
TIMEOUT_S = 900.0


def job(args: argparse.Namespace) -> TrainSettings:
    """The training settings both loops use: SGD with the server's defaults, constant lr."""
    return TrainSettings(
        epochs=args.epochs,
        global_batch=args.global_batch,
        optimizer="sgd",
        lr_schedule="constant",
        seed=args.seed,
    )


def local_slices(count: int, batch: int, world: int, rank: int) -> list[tuple[int, int]]:
    """Per step of an epoch, this rank's ``[start, stop)`` in the epoch's permutation."""
    out = []
    for start in range(0, count, batch):
        sizes = plan_equal(list(range(world)), min(batch, count - start))
        offset = start + sum(sizes.get(r, 0) for r in range(rank))
        out.append((offset, offset + sizes.get(rank, 0)))
    return out


def calibrate(
    ddp: nn.parallel.DistributedDataParallel, x: torch.Tensor, y: torch.Tensor, sizes: set[int]
) -> dict[int, float]:
    """Forward/backward seconds per local batch size, without communication: the fastest
    pass (the rule of ``launch.ddp.step.calibrated_time``)."""
    state = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    times = {}
    for size in sorted(sizes):
        samples = []
        for _ in range(CALIBRATION_PASSES):
            start = time.perf_counter()
            # The bare module: DDP's forward broadcasts buffers, a collective, and ranks
            # calibrate one at a time.
            nn.functional.cross_entropy(ddp.module(x[:size]), y[:size]).backward()
            samples.append(time.perf_counter() - start)
        times[size] = min(samples[2:])
    ddp.module.load_state_dict(state)
    ddp.module.zero_grad(set_to_none=True)
    return times


def plain_rank(args: argparse.Namespace) -> None:
    """One rank of the reference loop; rank 0 writes ``{"train_s": ...}`` to ``args.result``."""
    rank, world = args.rank, len(args.factors)
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", args.store_port, None, False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    with DatasetReader(args.dataset) as reader:
        train_idx = reader.train_indices
        x_np, y_np = reader.read(train_idx)
        meta = reader.meta
    x_all, y_all = torch.from_numpy(x_np), torch.from_numpy(y_np)
    torch.manual_seed(args.seed)
    model = build_model("hsi-cnn", meta.shape[0], meta.num_classes, meta.shape[1])
    ddp = nn.parallel.DistributedDataParallel(model)
    t = job(args)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=t.lr,
        momentum=t.momentum,
        nesterov=t.nesterov,
        weight_decay=t.weight_decay,
    )
    count = len(train_idx)
    slices = local_slices(count, args.global_batch, world, rank)
    compute: dict[int, float] = {}
    for turn in range(world):  # one rank at a time, as pslaunch ddp calibrates
        if turn == rank:
            compute = calibrate(ddp, x_all, y_all, {b - a for a, b in slices})
        dist.barrier()
    pause = {size: (args.factors[rank] - 1) * s for size, s in compute.items()}
    dist.barrier()
    begin = time.perf_counter()
    ends = [begin]
    for epoch in range(1, args.epochs + 1):
        perm = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(count))
        for a, b in slices:
            mine = perm[a:b]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(x_all[mine]), y_all[mine]).backward()
            optimizer.step()
            if pause[b - a] > 0:
                time.sleep(pause[b - a])
            ends.append(time.perf_counter())
    dist.barrier()
    train_s = time.perf_counter() - begin
    if rank == 0:
        step_s = statistics.median(np.diff(ends).tolist())
        result = {"train_s": train_s, "step_s": step_s, "compute_s": compute}
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()


Timing = tuple[float, float]  # (training seconds, median seconds from one step's end to the next)


def run_plain(data: Path, factors: list[float], args: argparse.Namespace, out: Path) -> Timing:
    """Run the reference loop once; return its timing."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False
    )
    result = out / "plain.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    common = [
        *("--dataset", str(data), "--slowdowns", ",".join(f"{f:g}" for f in factors)),
        *("--epochs", str(args.epochs), "--global-batch", str(args.global_batch)),
        *("--store-port", str(store.port), "--result", str(result), "--seed", str(args.seed)),
    ]
    try:
        with Children(sys.stdout, env, cwd=ROOT) as ranks:
            for r in range(len(factors)):
                argv = [sys.executable, "-m", "bench.ddp_fidelity", "--plain-rank", str(r), *common]
                ranks.start(f"rank{r}", argv)
            if not ranks.wait_all(TIMEOUT_S):
                raise RuntimeError(f"plain DDP ranks did not finish within {TIMEOUT_S} s")
            codes = [rank.code for rank in ranks.children]
    finally:
        del store
    if any(codes):
        raise RuntimeError(f"plain DDP ranks exited with {codes}")
    record = json.loads(result.read_text())
    return float(record["train_s"]), float(record["step_s"])


def run_pslaunch(data: Path, factors: list[float], args: argparse.Namespace, out: Path) -> Timing:
    """Run ``pslaunch ddp`` on the same job once; return its ``train_time_s`` and the median
    interval between its round events (an interval spanning an evaluation is one of ten
    per epoch's fifteen or so and leaves the median alone)."""
    config = DDPConfig(
        dataset=data,
        model="hsi-cnn",
        slowdowns=tuple(factors),
        run_dir=out / "pslaunch",
        train=job(args),
        run_timeout_s=TIMEOUT_S,
        overwrite=True,  # each repeat replaces the last
    )
    summary = run_ddp(config)
    events = read_history(config.run_dir / "metrics.jsonl")
    ends = [e["t"] for _, e in events if e["event"] in ("train_start", "round")]
    return float(summary["train_time_s"]), statistics.median(np.diff(ends).tolist())


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--repeats", type=int, default=3, help="repeats (default 3)")
    add("--epochs", type=int, default=10, help="epochs per run (default 10)")
    add("--slowdowns", default="1,2,4", help="rank slowdowns (default 1,2,4)")
    add("--global-batch", type=int, default=64, help="global batch (default 64)")
    add("--seed", type=int, default=0, help="seed (default 0)")
    add("--out", type=Path, default=ROOT / "runs/bench/ddp_fidelity", help="output directory")
    add("--plain-rank", type=int, help=argparse.SUPPRESS)
    add("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    add("--dataset", type=Path, help=argparse.SUPPRESS)
    add("--result", default="", help=argparse.SUPPRESS)
    args = parse_settings(parser, argv)
    args.factors = [float(f) for f in args.slowdowns.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both loops interleaved over repeats; print each time and the paired ratios."""
    args = parse(argv)
    if args.plain_rank is not None:
        args.rank = args.plain_rank
        plain_rank(args)
        return 0
    setup_logging("WARNING")
    if (reason := jasper_missing()) is not None:
        print(reason)
        return 2
    data = jasper(args.out)
    runners = {"plain": run_plain, "pslaunch": run_pslaunch}
    times: dict[str, list[Timing]] = {name: [] for name in runners}
    print(
        f"hsi-cnn, Jasper Ridge 5x5, 10 % train, B={args.global_batch}, {args.epochs} epochs, "
        f"slowdowns {args.slowdowns}, 1 thread per rank, gloo"
    )
    for rep in range(args.repeats):
        order = list(runners) if rep % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name].append(runners[name](data, args.factors, args, args.out))
        (plain_s, plain_step), (ps_s, ps_step) = times["plain"][-1], times["pslaunch"][-1]
        print(
            f"repeat {rep}: train s plain {plain_s:.2f} / pslaunch ddp {ps_s:.2f} "
            f"(ratio {ps_s / plain_s:.3f}); median step ms plain {1000 * plain_step:.2f} / "
            f"pslaunch ddp {1000 * ps_step:.2f} (ratio {ps_step / plain_step:.3f})",
            flush=True,
        )
    for index, label in ((0, "train_s"), (1, "step_ms")):
        scale = 1.0 if index == 0 else 1000.0
        for name, values in times.items():
            print(
                f"{label}_{name}_median={scale * statistics.median(v[index] for v in values):.2f}"
            )
    for index, label in ((0, ""), (1, "step_")):
        ratios = [
            p[index] / q[index] for p, q in zip(times["pslaunch"], times["plain"], strict=True)
        ]
        print(f"ratio_{label}pslaunch_vs_plain={statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
