"""Which part of a weighted-sync round disturbs a BatchNorm model: one experiment per hypothesis.

Replays weighted-sync's arithmetic in one process, without servers or timing, so every
variant sees the same samples in the same order: each round, worker i computes the mean
gradient and the BatchNorm statistics change of its local batch b_i in training mode, the
server applies g = sum_i w_i g_i with SGD (momentum 0.9, lr 0.05) and adds sum_i w_i dbuf_i
to the running statistics. The test OA (on a fixed random 3000 of the test samples) is
measured after every step. The variants are described in docs/training-quality.md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench import ROOT
from bench.harness.jasper import jasper
from bench.harness.record import parse_settings
from common.data.dataset import DatasetReader
from common.training.models import build_model
from common.training.planner import plan_batches
from common.training.tables import format_table
from launch.compare import max_drop

TEST_SAMPLES = 3000  # a fixed random subset of the test split, scored after every step
VARIANTS = (
    "baseline",
    "tail-split",
    "tail-no-stats",
    "tail-no-grad",
    "tail-scaled",
    "no-momentum",
    "carry-over",
    "drop-small",
    "global-bn",
    "scaled-min8",
    "one-worker",
)


def rounds(n: int, batch: int, epochs: int, seed: int, carry: bool) -> list[np.ndarray]:
    """Global batches of positions: per epoch a fresh permutation; with ``carry`` an epoch's
    tail opens the next epoch's first round (the last tail is dropped)."""
    out: list[np.ndarray] = []
    left = np.empty(0, dtype=np.int64)
    for e in range(1, epochs + 1):
        perm = np.random.default_rng(seed + e).permutation(n)
        if carry:
            perm = np.concatenate([left, perm])
        full = len(perm) // batch * batch
        out += [perm[i : i + batch] for i in range(0, full, batch)]
        left = perm[full:]
        if not carry and len(left):
            out.append(left)
    return out


class Replay:
    """One model trained by replaying weighted-sync rounds in a chosen variant."""

    def __init__(self, data: Path, seed: int, *, momentum: float) -> None:
        self.reader = DatasetReader(data)
        meta = self.reader.meta
        torch.manual_seed(seed)
        shape = meta.shape
        self.model = build_model("hsi-cnn", shape[0], meta.num_classes, shape[-1])
        self.params = list(self.model.parameters())
        self.buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        self.opt = torch.optim.SGD(self.params, lr=0.05, momentum=momentum)
        train = self.reader.train_indices
        x, y = self.reader.read(np.sort(train))
        self.x, self.y = torch.from_numpy(x).float(), torch.from_numpy(y).long()
        test = np.random.default_rng(0).permutation(self.reader.test_indices)[:TEST_SAMPLES]
        tx, ty = self.reader.read(np.sort(test))
        self.tx, self.ty = torch.from_numpy(tx).float(), torch.from_numpy(ty).long()

    def local(self, idx: np.ndarray) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Mean gradient and buffer change of one local batch, the model left as it was."""
        before = [b.clone() for b in self.buffers]
        self.model.train()
        self.model.zero_grad()
        nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx]).backward()
        grads = [p.grad.clone() for p in self.params]  # type: ignore[union-attr]
        change = [b - b0 for b, b0 in zip(self.buffers, before, strict=True)]
        for b, b0 in zip(self.buffers, before, strict=True):
            b.copy_(b0)
        return grads, change

    def step(
        self,
        parts: list[np.ndarray],
        weights: list[float],
        grad_w: float,
        buf_w: float,
        stats_of: np.ndarray | None = None,
    ) -> None:
        """Apply sum_i w_i g_i (times ``grad_w``) and add sum_i w_i dbuf_i (times ``buf_w``);
        with ``stats_of``, the statistics change comes from that batch instead."""
        total_g = [torch.zeros_like(p) for p in self.params]
        total_b = [torch.zeros_like(b) for b in self.buffers]
        for idx, w in zip(parts, weights, strict=True):
            g, db = self.local(idx)
            for t, v in zip(total_g, g, strict=True):
                t.add_(v, alpha=w)
            for t, v in zip(total_b, db, strict=True):
                t.add_(v, alpha=w)
        if stats_of is not None:
            _, total_b = self.local(stats_of)
        if grad_w > 0:
            for p, grad in zip(self.params, total_g, strict=True):
                p.grad = grad * grad_w
            self.opt.step()
        with torch.no_grad():
            for b, delta in zip(self.buffers, total_b, strict=True):
                b.add_(delta, alpha=buf_w)

    @torch.no_grad()
    def oa(self) -> float:
        """Overall accuracy on the test split (running statistics)."""
        self.model.eval()
        pred = torch.cat(
            [self.model(self.tx[i : i + 4096]).argmax(1) for i in range(0, len(self.ty), 4096)]
        )
        return float((pred == self.ty).float().mean())


def run(
    data: Path, variant: str, seed: int, epochs: int, batch: int, slowdowns: list[float]
) -> tuple[float, float]:
    """Train one variant; returns (max drop after the first epoch, final OA)."""
    replay = Replay(data, seed, momentum=0.0 if variant == "no-momentum" else 0.9)
    n = len(replay.y)
    carry = variant in ("carry-over", "drop-small", "global-bn")
    shares = plan_batches({i: 1.0 / s for i, s in enumerate(slowdowns)}, batch)
    if variant in ("drop-small", "scaled-min8"):
        small = [w for w, b in shares.items() if b < (16 if variant == "drop-small" else 8)]
        big = max(shares, key=lambda w: shares[w])
        for w in small:
            shares[big] += shares.pop(w)
    if variant == "one-worker":
        shares = {0: batch}
    sizes = [shares[w] for w in sorted(shares)]
    oas: list[float] = []
    per_epoch = n // batch if carry else -(-n // batch)
    for r in rounds(n, batch, epochs, seed, carry):
        b = len(r)
        if b < batch:  # a tail round
            split = variant == "tail-split"
            parts = [r[i : i + 1] for i in range(b)] if split else [r]
            weights = [len(p) / b for p in parts]
            scaled = b / batch if variant in ("tail-scaled", "scaled-min8", "one-worker") else 1.0
            grad_w = 0.0 if variant == "tail-no-grad" else scaled
            buf_w = 0.0 if variant == "tail-no-stats" else scaled
            replay.step(parts, weights, grad_w, buf_w)
        else:
            cuts = np.cumsum(sizes)[:-1]
            parts = np.split(r, cuts)
            weights = [len(p) / b for p in parts]
            replay.step(parts, weights, 1.0, 1.0, r if variant == "global-bn" else None)
        oas.append(replay.oa())
    curve = [{"samples": step, "oa": oa} for step, oa in enumerate(oas)]  # a point per step
    return max_drop(curve, per_epoch) or 0.0, oas[-1]


def main(argv: list[str] | None = None) -> int:
    """Run every variant over the seeds; print max drop and final OA (median and max)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="model and order seeds (default 0,1,2)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="variants to run")
    parser.add_argument("--epochs", type=int, default=6, help="epochs (default 6)")
    parser.add_argument("--global-batch", type=int, default=64, help="B (default 64)")
    parser.add_argument("--slowdowns", default="4,4,8,16", help="worker slowdowns (4,4,8,16)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench/tail_rounds")
    args = parse_settings(parser, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    data = jasper(args.out, 5, 0.1)
    seeds = [int(s) for s in args.seeds.split(",")]
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    rows = []
    columns = ["variant", "max drop per seed", "median / max", "final OA"]
    for variant in args.variants.split(","):
        got = [run(data, variant, s, args.epochs, args.global_batch, slowdowns) for s in seeds]
        drops, finals = [d for d, _ in got], [f for _, f in got]
        drop_range = f"{statistics.median(drops):.3f} / {max(drops):.3f}"
        per_seed = " ".join(f"{d:.3f}" for d in drops)
        rows.append([variant, per_seed, drop_range, f"{statistics.median(finals):.4f}"])
        print(format_table(columns, rows[-1:]), flush=True)
    print(format_table(columns, rows))
    for variant, _, drop, final in rows:
        print(f"max_drop_{variant}={drop.split(' / ')[0]} final_oa_{variant}={final}")
    return 0
