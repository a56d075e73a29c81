"""Fixed cost of a round: the PS round against the same step in one process, and against the
floor of an asyncio + ZeroMQ server measured beside it.

A round's overhead is the round's time outside its worker's compute, paired round by round
(sync: the round's time less its slowest worker's reported compute; async: the time from a
worker's push to its next less that push's compute), less the optimizer step the in-process
loop runs (the server runs it): the same quantity as the median round less the median
in-process step, without the scatter of two 30 ms medians taken apart. That unpaired figure is
printed beside it. With ``--baseline DIR`` every PS run is also made with that checkout's code,
right after this code's (the order flips every repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.harness.jasper import jasper
from bench.harness.record import parse_settings
from bench.round_floor import _asyncio_step_echo, round_trip_s, step_s
from common.data import JASPER_DIR
from common.data.dataset import DatasetReader
from common.training.models import build_model
from launch.local import LocalCluster, run_local
from pserver.config import ServerConfig
from pserver.history import read_history

BATCH = 64
WARMUP = 10


def in_process_step_s(dataset: Path, steps: int) -> tuple[float, float, float]:
    """Median and 10th-percentile seconds of one forward/backward/SGD step on 64 in-memory
    training samples, and the median of its SGD step alone."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with DatasetReader(dataset) as reader:
        meta = reader.meta
        x_np, y_np = reader.read(reader.train_indices)
    x, y = torch.from_numpy(x_np.copy()), torch.from_numpy(y_np.copy())
    channels, size, _ = meta.shape
    model = build_model("hsi-cnn", channels, meta.num_classes, size).train()
    cfg = ServerConfig
    opt = torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
    batches = len(y) // BATCH
    times, sgd = [], []
    for step in range(steps + WARMUP):
        lo = (step % batches) * BATCH
        begin = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
        loss.backward()
        computed = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - begin)
        sgd.append(time.perf_counter() - computed)
    return statistics.median(times[WARMUP:]), low(times[WARMUP:]), statistics.median(sgd[WARMUP:])


def ps_round_s(
    dataset: Path, mode: str, workers: int, rounds: int, run_dir: Path, tree: Path | None = None
) -> tuple[float, float, float, float]:
    """Median round time (weighted-sync: full 64-sample rounds; async: one worker's push to its
    next), the mean time between rounds (every cost included), the 10th percentile of round
    times and the median round time outside compute (paired, see above), with real processes
    on loopback."""
    # child processes (``python -m ...``) import the project from ``tree`` (None: this one)
    with contextlib.chdir(tree) if tree is not None else contextlib.nullcontext():
        steps = (rounds + WARMUP) * (workers if mode == "async" else 1)
        cluster = LocalCluster(
            dataset=dataset,
            model="hsi-cnn",
            mode=mode,
            slowdowns=(1.0,) * workers,
            run_dir=run_dir,
            server_options=(
                *("--max-steps", str(steps), "--global-batch", str(BATCH)),
                *("--eval-every", "1000000"),
            ),
        )
        run_local(cluster)
    events = [event for _, event in read_history(run_dir / "metrics.jsonl")]
    if mode == "async":
        pushes = [e for e in events if e["event"] == "push"]
        pairs = [
            (b["t"] - a["t"], b.get("compute_s", math.nan))  # nan: a tree that logs none
            for name in {e["worker"] for e in pushes}
            for a, b in itertools.pairwise([e for e in pushes if e["worker"] == name][WARMUP:])
        ]
    else:
        rounds_ = [e for e in events if e["event"] == "round"][WARMUP:]
        pairs = [
            (r["round_s"], max(w["compute_s"] for w in r["workers"]))
            for r in rounds_
            if sum(w["batch"] for w in r["workers"]) == BATCH
        ]
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(rounds_)]
    times = [t for t, _ in pairs]
    outside = statistics.median(t - c for t, c in pairs)
    mean_gap = statistics.mean(times if mode == "async" else gaps)
    return statistics.median(times), mean_gap, low(times), outside


def floor_overhead_s(clients: int, gather: int, requests: int, compute_s: float) -> float:
    """``round-floor``'s asyncio step server with ``clients`` clients that compute ``compute_s``
    between rounds (``gather`` gradients per step): its median round trip less the step run
    hot."""
    rtt = round_trip_s(requests, compute_s, _asyncio_step_echo, clients, gather)
    return rtt - step_s(requests)


def low(times: list[float]) -> float:
    """The 10th percentile: bursts of load from other processes on a shared machine inflate
    the median; the fast tail shows the cost without them."""
    return statistics.quantiles(times, n=10)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,3", help="worker counts, comma-separated")
    parser.add_argument("--modes", default="weighted-sync,async", help="modes, comma-separated")
    parser.add_argument("--floor-requests", type=int, default=300, help="round trips per floor")
    parser.add_argument("--jasper", type=Path, default=JASPER_DIR)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    args = parse_settings(parser, argv)
    counts = [int(n) for n in args.workers.split(",")]
    runs = [(m, n) for m in args.modes.split(",") for n in counts]
    trees: dict[str, Path | None] = {"this": None}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = jasper(Path(tmp), jasper_dir=args.jasper)
        local: list[tuple[float, float, float]] = []
        floors: dict[tuple[int, int], list[float]] = {}  # (clients, gather) -> per repeat
        floor = {(m, n): floors.setdefault((n, 1 if m == "async" else n), []) for m, n in runs}
        ps: dict[tuple[str, str, int], list[tuple[float, float, float, float]]] = {
            (t, m, n): [] for t in trees for m, n in runs
        }
        for repeat in range(args.repeats):
            local.append(in_process_step_s(dataset, args.rounds))
            line = f"repeat {repeat}: in-process step {local[-1][0] * 1e3:6.2f} ms"
            order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
            for m, n in runs:
                if len(floor[m, n]) == repeat:  # one client: the same floor in either mode
                    gather = 1 if m == "async" else n
                    floor[m, n].append(
                        floor_overhead_s(n, gather, args.floor_requests, local[-1][0])
                    )
                line += f" | floor {m} {n}w {floor[m, n][-1] * 1e3:5.2f} ms"
                for name in order:
                    run_dir = Path(tmp) / f"{name}-{m}-{n}-{repeat}"
                    ps[name, m, n].append(
                        ps_round_s(dataset, m, n, args.rounds, run_dir, trees[name])
                    )
                    line += f" | {name} {m} {n}w round {ps[name, m, n][-1][0] * 1e3:6.2f} ms"
            print(line, flush=True)
    step = statistics.median(s[0] for s in local)
    step_low = statistics.median(s[1] for s in local)
    print(f"hsi-cnn, Jasper Ridge, {BATCH}-sample rounds, {args.rounds} rounds x {args.repeats}")
    sgd = statistics.median(s[2] for s in local)
    print(
        f"in-process step: median {step * 1e3:.2f} ms, 10th percentile {step_low * 1e3:.2f} ms, "
        f"its SGD step {sgd * 1e3:.2f} ms"
    )
    figures = []
    for (name, m, n), got in ps.items():
        over = [r[3] - s[2] for r, s in zip(got, local, strict=True)]
        apart = [r[0] - s[0] for r, s in zip(got, local, strict=True)]
        over_low = [r[2] - s[1] for r, s in zip(got, local, strict=True)]
        ratio = statistics.median(o / f for o, f in zip(over, floor[m, n], strict=True))
        print(
            f"{name:8s} {m} {n} worker{'s' if n > 1 else ' '}: round median "
            f"{statistics.median(r[0] for r in got) * 1e3:6.2f} ms (mean gap "
            f"{statistics.median(r[1] for r in got) * 1e3:6.2f}), overhead "
            f"{statistics.median(over) * 1e3:6.2f} ms, floor "
            f"{statistics.median(floor[m, n]) * 1e3:5.2f} ms, {ratio:.2f}x the floor; medians "
            f"taken apart: overhead {statistics.median(apart) * 1e3:6.2f} ms; 10th "
            f"percentiles: round {statistics.median(r[2] for r in got) * 1e3:6.2f} ms, "
            f"overhead {statistics.median(over_low) * 1e3:6.2f} ms"
        )
        prefix = "" if name == "this" else f"{name}_"
        suffix = ("_async" if m == "async" else "") + ("" if n == 1 else f"_{n}_workers")
        figures.append(f"{prefix}overhead{suffix}_ms={statistics.median(over) * 1e3:.2f}")
        if name == "this":
            figures.append(f"floor_overhead{suffix}_ms={statistics.median(floor[m, n]) * 1e3:.3f}")
        figures.append(f"{prefix}overhead_over_floor{suffix}={ratio:.2f}")
        if name == "baseline":
            pairs = zip(got, ps["this", m, n], strict=True)
            paired = statistics.median(b[0] / t[0] for b, t in pairs)
            print(f"  baseline round / this round: {paired:.2f}")
    print("\n".join(figures))  # the kept figures
