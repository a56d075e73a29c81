"""Fixed cost of a weighted-sync round: the PS round against the same step in one process.

hsi-cnn on Jasper Ridge (5x5 patches, 10 % train, seed 0), 64-sample rounds. Each repeat runs,
one after the other in this one invocation:

- ``in-process``: forward, backward and a ``torch.optim.SGD`` step (the server's lr, momentum
  and weight decay) on the same model with 64-sample batches of the same training data, held in
  memory, on one torch thread (a worker's default);
- ``ps 1 worker``: a real ``pserver start`` and one ``worker join`` process on 127.0.0.1
  (weighted-sync, evaluation only at the end), the server's round times from metrics.jsonl;
- ``ps 3 workers`` (unless ``--workers 1``): the same with three workers of equal speed.

With ``--baseline DIR`` (another checkout of the project, e.g. ``git worktree add ../baseline
main``) every PS run is also made with that code, right after this code's (the order flips
every repeat), so a change is measured side by side on the same noisy machine.

A round's overhead is its median round time minus the median in-process step of the same
repeat. The last lines print the medians over repeats and the kept figures: ``overhead_ms``
(one worker), ``overhead_N_workers_ms`` and, with a baseline, the same prefixed ``baseline_``.

Needs the Jasper Ridge files (``--jasper``, default ../shared/datasets/jasper_ridge).

Usage: python -m bench round-overhead [--rounds 200] [--repeats 3] [--workers 1,3]
                                      [--baseline DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from bench.harness.jasper import JASPER_DIR, jasper
from bench.harness.record import parse_settings
from common.data.dataset import DatasetReader
from common.training.models import build_model
from launch.local import LocalCluster, run_local
from pserver.config import ServerConfig

BATCH = 64
WARMUP = 10


def in_process_step_s(dataset: Path, steps: int) -> tuple[float, float]:
    """Median and 10th-percentile seconds of one forward/backward/SGD step on 64 in-memory
    training samples."""
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
    times = []
    for step in range(steps + WARMUP):
        lo = (step % batches) * BATCH
        begin = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - begin)
    return statistics.median(times[WARMUP:]), low(times[WARMUP:])


@contextlib.contextmanager
def code_from(tree: Path | None) -> Iterator[None]:
    """Child processes (``python -m ...``) import the project from ``tree`` (None: this one)."""
    if tree is None:
        yield
        return
    here = Path.cwd()
    os.chdir(tree)
    try:
        yield
    finally:
        os.chdir(here)


def ps_round_s(
    dataset: Path, workers: int, rounds: int, run_dir: Path, tree: Path | None = None
) -> tuple[float, float, float]:
    """Median round time of full 64-sample weighted-sync rounds, the mean time between
    consecutive round events (every cost included) and the 10th percentile of round times,
    with real processes on loopback."""
    with code_from(tree):
        _run_ps(dataset, workers, rounds, run_dir)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds_ = [e for e in events if e["event"] == "round"][WARMUP:]
    full = [r for r in rounds_ if sum(w["batch"] for w in r["workers"]) == BATCH]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(rounds_)]
    return (
        statistics.median(r["round_s"] for r in full),
        statistics.mean(gaps),
        low([r["round_s"] for r in full]),
    )


def low(times: list[float]) -> float:
    """The 10th percentile: bursts of load from other processes on a shared machine inflate
    the median; the fast tail shows the cost without them."""
    return statistics.quantiles(times, n=10)[0]


def _run_ps(dataset: Path, workers: int, rounds: int, run_dir: Path) -> None:
    run_local(
        LocalCluster(
            dataset=dataset,
            model="hsi-cnn",
            mode="weighted-sync",
            slowdowns=(1.0,) * workers,
            run_dir=run_dir,
            server_options=(
                "--max-steps",
                str(rounds + WARMUP),
                "--global-batch",
                str(BATCH),
                "--eval-every",
                "1000000",
            ),
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,3", help="worker counts, comma-separated")
    parser.add_argument("--jasper", type=Path, default=JASPER_DIR)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    args = parse_settings(parser, argv)
    counts = [int(n) for n in args.workers.split(",")]
    trees: dict[str, Path | None] = {"this": None}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = jasper(Path(tmp), jasper_dir=args.jasper)
        local: list[tuple[float, float]] = []
        ps: dict[tuple[str, int], list[tuple[float, float, float]]] = {
            (t, n): [] for t in trees for n in counts
        }
        for repeat in range(args.repeats):
            local.append(in_process_step_s(dataset, args.rounds))
            line = f"repeat {repeat}: in-process step {local[-1][0] * 1e3:6.2f} ms"
            order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
            for n in counts:
                for name in order:
                    run_dir = Path(tmp) / f"{name}-{n}-{repeat}"
                    ps[name, n].append(ps_round_s(dataset, n, args.rounds, run_dir, trees[name]))
                    line += f" | {name} {n}w round {ps[name, n][-1][0] * 1e3:6.2f} ms"
            print(line, flush=True)
    step = statistics.median(s[0] for s in local)
    step_low = statistics.median(s[1] for s in local)
    print(f"hsi-cnn, Jasper Ridge, {BATCH}-sample rounds, {args.rounds} rounds x {args.repeats}")
    print(f"in-process step: median {step * 1e3:.2f} ms, 10th percentile {step_low * 1e3:.2f} ms")
    for (name, n), runs in ps.items():
        over = [r[0] - s[0] for r, s in zip(runs, local, strict=True)]
        over_low = [r[2] - s[1] for r, s in zip(runs, local, strict=True)]
        print(
            f"{name:8s} ps {n} worker{'s' if n > 1 else ' '}: round median "
            f"{statistics.median(r[0] for r in runs) * 1e3:6.2f} ms (mean gap "
            f"{statistics.median(r[1] for r in runs) * 1e3:6.2f}), overhead "
            f"{statistics.median(over) * 1e3:6.2f} ms; 10th percentiles: round "
            f"{statistics.median(r[2] for r in runs) * 1e3:6.2f} ms, overhead "
            f"{statistics.median(over_low) * 1e3:6.2f} ms"
        )
    if "baseline" in trees:
        for n in counts:
            pairs = list(zip(ps["baseline", n], ps["this", n], strict=True))
            ratio = statistics.median(b[0] / t[0] for b, t in pairs)
            ratio_low = statistics.median(b[2] / t[2] for b, t in pairs)
            print(
                f"{n} worker(s): baseline round / this round = {ratio:.2f} "
                f"(10th percentiles: {ratio_low:.2f})"
            )
    for (name, n), runs in ps.items():  # the kept figures: overhead_ms is this code's, 1 worker
        over = [r[0] - s[0] for r, s in zip(runs, local, strict=True)]
        prefix = "" if name == "this" else f"{name}_"
        suffix = "" if n == 1 else f"_{n}_workers"
        print(f"{prefix}overhead{suffix}_ms={statistics.median(over) * 1e3:.2f}")


if __name__ == "__main__":
    main()
