"""The simulation loops: synchronous rounds (weighted-sync, equal-sync), async pushes in event
order, and DDP steps, each planned and scaled by the server's own planner and staleness code.

Weighted-sync plans every round with the server's ``WeightedPlanner`` (its planner, spread rule,
probes and minimum local batch) on each node's model, its transfer time the one it took in its
last rounds, the spread of round times measured from the simulated rounds. Async gives each
worker the server's ``async_batches``, applies pushes first come, first served, and refuses
those that ``too_stale`` refuses (the worker re-pulls and recomputes the same samples); the
learning-rate factor of each push is the server's ``lr_scale``.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Any

import numpy as np

from common.config import need
from common.training.perfmodel import WINDOW, Fit, robust_location
from common.training.planner import WeightedPlanner, async_batches, plan_equal
from launch.simulate.costs import (
    ShardedRound,
    cpu_stretch,
    ddp_step_s,
    one_way_s,
    push_cost_s,
    ring_allreduce_s,
    worker_cpu_s,
)
from launch.simulate.spec import FP32_BYTES, Cluster
from pserver.policies.staleness import lr_scale, staleness_function, too_stale

SIM_MODES = ("weighted-sync", "equal-sync", "async", "ddp")
MIN_COMPUTE_SHARE = 0.2  # jitter never makes a step shorter than this share of its mean
MAX_WORK = 20_000_000  # rounds x nodes simulated at most (about two minutes)


@dataclasses.dataclass
class ModeResult:
    """What a simulation of one mode on one cluster predicts.

    Attributes:
        mode: the mode.
        workers: nodes in the cluster.
        shards: parameter shards (1 for DDP).
        rounds: rounds (async: pushes) simulated.
        round_s: mean time of a round (async: time to apply one global batch of samples).
        epoch_s: time of one epoch.
        extrapolated: the epoch time comes from fewer rounds than an epoch has.
        idle_share: share of member round time spent waiting at the barrier (sync, DDP).
        comm_s: mean part of a round after the slowest member's compute (sync, DDP).
        members: mean members per round (weighted-sync may leave slow workers out).
        worker_link_bytes: mean per round of the busiest worker host's link (both ways;
            async: per push).
        server_link_bytes: mean per round of the busiest shard host's traffic (both ways;
            async: per global batch of samples applied).
        ring_s: a ring all-reduce of the model over the slowest link (reference).
        staleness: async: mean, max and histogram {tau: pushes} of applied pushes.
        rejected: async: pushes refused as too stale.
        lr_factor_mean: async: mean (b_i / B) * f(tau) of applied pushes.
        groups: per node group: ``nodes``, ``members`` (mean members per round; async: None)
            and ``share`` (of the samples computed).
    """

    mode: str
    workers: int
    shards: int
    rounds: int
    round_s: float
    epoch_s: float
    extrapolated: bool
    idle_share: float | None = None
    comm_s: float | None = None
    members: float | None = None
    worker_link_bytes: float = 0.0
    server_link_bytes: float = 0.0
    ring_s: float = 0.0
    staleness: dict[str, Any] | None = None
    rejected: int = 0
    lr_factor_mean: float | None = None
    groups: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (floats rounded)."""
        items = dataclasses.asdict(self).items()
        return {k: round(v, 9) if isinstance(v, float) else v for k, v in items}


def round_sizes(cluster: Cluster, epochs: int, max_rounds: int | None) -> tuple[list[int], int]:
    """The global batch of every round to simulate and the rounds in one epoch.

    An epoch of S samples takes ceil(S / B) rounds, the last one with what is left.
    """
    per_epoch = math.ceil(cluster.samples / cluster.global_batch)
    tail = cluster.samples - (per_epoch - 1) * cluster.global_batch
    count = per_epoch * epochs if max_rounds is None else min(max_rounds, per_epoch * epochs)
    return [
        tail if r % per_epoch == per_epoch - 1 else cluster.global_batch for r in range(count)
    ], per_epoch


class Jitter:
    """Compute times with the nodes' round-to-round scatter, from one seeded generator."""

    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.rel = np.array([n.jitter for n in cluster.nodes])
        self.abs = np.array([n.jitter_s for n in cluster.nodes])
        self.alpha = np.array([n.alpha_s for n in cluster.nodes])
        self.beta = np.array([n.beta_s for n in cluster.nodes])
        self.any = bool(self.rel.any() or self.abs.any())

    def compute(self, idx: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """Compute time of nodes ``idx`` on batches ``batch`` (one draw each)."""
        mean = self.alpha[idx] + self.beta[idx] * batch
        if not self.any:
            return mean
        z = self.rng.standard_normal(len(idx))
        noisy = mean * (1 + self.rel[idx] * z) + self.abs[idx] * z
        return np.maximum(noisy, MIN_COMPUTE_SHARE * mean)


def simulate(
    cluster: Cluster,
    mode: str,
    epochs: int = 1,
    max_rounds: int | None = None,
    seed: int = 0,
    plan_spread: bool = True,
) -> ModeResult:
    """Simulate ``mode`` on ``cluster``.

    Args:
        cluster: the cluster.
        mode: one of ``SIM_MODES``.
        epochs: epochs to simulate.
        max_rounds: simulate at most this many rounds (async: this many pushes per worker)
            and extrapolate the epoch time from them.
        seed: seeds the jitter of compute times.
        plan_spread: weighted-sync weighs the measured spread of round times (the server's
            ``--plan-spread``).

    Returns:
        The prediction.

    Raises:
        ValueError: unknown mode.
        ConfigError: more than ``MAX_WORK`` rounds x nodes to simulate (``max_rounds``
            extrapolates from fewer).
    """
    rounds = math.ceil(cluster.samples / cluster.global_batch) * epochs
    work = min(rounds, max_rounds or rounds) * len(cluster.nodes)
    need(
        work <= MAX_WORK,
        f"{mode}: {rounds:,} rounds of {len(cluster.nodes):,} nodes is more than this tool "
        f"simulates ({MAX_WORK:,} node rounds); give --rounds R (at most "
        f"{MAX_WORK // len(cluster.nodes):,}) to extrapolate the epoch from R rounds",
    )
    if mode in ("weighted-sync", "equal-sync", "ddp"):
        return _rounds(cluster, mode, epochs, max_rounds, seed, plan_spread)
    if mode == "async":
        return _async(cluster, epochs, max_rounds, seed)
    raise ValueError(f"unknown mode {mode!r}; choose from {SIM_MODES}")


def group_stats(
    cluster: Cluster, rounds_in: np.ndarray | None, samples: np.ndarray, rounds: int
) -> dict[str, dict[str, Any]]:
    """Per node group (the name before ``#``): its nodes, mean members per round (None
    without rounds) and share of the samples computed."""
    out: dict[str, dict[str, Any]] = {}
    total = max(float(samples.sum()), 1.0)
    for i, node in enumerate(cluster.nodes):
        group = out.setdefault(node.name.rsplit("#", 1)[0], {"nodes": 0, "members": 0.0})
        group["nodes"] += 1
        group["share"] = group.get("share", 0.0) + float(samples[i]) / total
        if rounds_in is not None:
            group["members"] += float(rounds_in[i]) / max(rounds, 1)
    for group in out.values():
        group["members"] = None if rounds_in is None else group["members"]
    return out


def _ring_s(cluster: Cluster) -> float:
    rate = min(n.link_bytes_s for n in cluster.nodes)
    latency = max(n.latency_s for n in cluster.nodes)
    return ring_allreduce_s(cluster.wire_bytes, len(cluster.nodes), rate, latency)


def _speeds(cluster: Cluster) -> dict[int, float]:
    """Each node's speed in samples per second at an equal share of a global batch."""
    ref = max(1, cluster.global_batch // len(cluster.nodes))
    return {i: ref / node.compute_s(ref) for i, node in enumerate(cluster.nodes)}


class _Planner:
    """Weighted-sync's or equal-sync's plan for each round, as the server's policies make it.

    As the server's ``PerfModel``, a node's transfer time is the robust centre
    (``robust_location``) of its last ``WINDOW`` steady rounds (rounds it was in after being in
    the one before: a re-probe's round does not describe it), and the spread of round times
    is measured over steady members only.
    """

    def __init__(self, cluster: Cluster, mode: str, *, plan_spread: bool) -> None:
        self.mode, self.nodes, self.speeds = mode, cluster.nodes, _speeds(cluster)
        self.transfer = {i: n.transfer_s or 0.0 for i, n in enumerate(cluster.nodes)}
        self.windows = {  # nodes with a measured transfer time keep it
            i: collections.deque[float](maxlen=WINDOW)
            for i, n in enumerate(cluster.nodes)
            if n.transfer_s is None
        }
        self.last_members: set[int] = set()
        self.weighted = WeightedPlanner(
            planner=cluster.planner, plan_spread=plan_spread, min_batch=cluster.min_local_batch
        )

    def fits(self) -> dict[int, Fit]:
        return {i: Fit(n.alpha_s, n.beta_s, self.transfer[i]) for i, n in enumerate(self.nodes)}

    def plan(self, total: int) -> dict[int, int]:
        if self.mode == "equal-sync":
            return plan_equal(list(range(len(self.nodes))), total)
        return self.weighted.plan(self.speeds, self.fits(), total)

    def closed(
        self, members: np.ndarray, batch: np.ndarray, compute: np.ndarray, actual: np.ndarray
    ) -> None:
        """Feed a closed round back: steady members' transfer times and spread."""
        if self.mode != "weighted-sync":
            return
        fits = self.fits()
        steady = [j for j, i in enumerate(members.tolist()) if i in self.last_members]
        self.last_members = set(members.tolist())
        predicted = [fits[int(members[j])].predict(int(batch[j])) for j in steady]
        self.weighted.spread.add_round([float(actual[j]) for j in steady], predicted)
        self.learn([int(members[j]) for j in steady], [actual[j] - compute[j] for j in steady])

    def learn(self, nodes: list[int], transfer_s: list[float]) -> None:
        """Nodes' times outside compute in a round (nodes with a measured one keep it)."""
        for i, seconds in zip(nodes, transfer_s, strict=True):
            if (window := self.windows.get(i)) is not None:
                window.append(max(float(seconds), 0.0))
                self.transfer[i] = robust_location(list(window))


def _rounds(
    cluster: Cluster, mode: str, epochs: int, max_rounds: int | None, seed: int, plan_spread: bool
) -> ModeResult:
    """Synchronous rounds: the parameter server's (sharded rounds) or DDP's (equal local
    batches, buckets all-reduced during backward, then the optimizer step on every rank)."""
    sizes, per_epoch = round_sizes(cluster, epochs, max_rounds)
    jitter = Jitter(cluster, seed)
    ddp = mode == "ddp"
    planner = _Planner(cluster, "equal-sync" if ddp else mode, plan_spread=plan_spread)
    transfer = np.array([np.nan if n.transfer_s is None else n.transfer_s for n in cluster.nodes])
    rounds: dict[tuple[int, ...], ShardedRound] = {}
    optimizer_s = cluster.server.step_s + cluster.server.step_s_per_byte * (
        cluster.model_params * FP32_BYTES
    )
    if cluster.ddp_allreduce_s is not None:  # measured as the step minus compute: it is in
        optimizer_s = 0.0
    n_nodes = len(cluster.nodes)
    ring_bytes = 2 * 2 * (n_nodes - 1) / n_nodes * cluster.wire_bytes  # both directions

    def layout(members: np.ndarray) -> ShardedRound:
        key = tuple(members.tolist())
        if key not in rounds:
            rounds.clear()  # plans change rarely: keep the current layout only
            rounds[key] = ShardedRound(cluster, members)
        return rounds[key]

    if mode == "weighted-sync":  # the transfer the planner starts from: an equal round's
        plan = plan_equal(list(range(n_nodes)), cluster.global_batch)
        members = np.array(sorted(plan))
        batch = np.array([plan[int(i)] for i in members])
        compute = jitter.alpha[members] + jitter.beta[members] * batch
        dry = layout(members).times(compute, transfer[members])
        planner.learn(members.tolist(), (dry.accepted_s - compute).tolist())
    times: list[float] = []
    idle = busy = comm = members_sum = worker_bytes = server_bytes = 0.0
    rounds_in, samples = np.zeros(n_nodes), np.zeros(n_nodes)
    for total in sizes:
        plan = planner.plan(total)
        members = np.array(sorted(plan))
        batch = np.array([plan[int(i)] for i in members])
        rounds_in[members] += batch > 0
        samples[members] += batch
        compute = jitter.compute(members, batch)
        if ddp:  # a rank is in the barrier when its compute ends
            accepted, round_s = compute, ddp_step_s(cluster, compute) + optimizer_s
        else:
            timed = layout(members).times(compute, transfer[members])
            planner.closed(members, batch, compute, timed.accepted_s)
            accepted, round_s = timed.accepted_s, timed.round_s
            worker_bytes += float(timed.worker_bytes.max())
            server_bytes += float(timed.shard_bytes.max())
        last = float(accepted.max())
        times.append(round_s)
        idle += float((last - accepted).sum())
        busy += float(accepted.sum()) + float((last - accepted).sum())
        comm += round_s - float(compute.max())
        members_sum += len(members)
    n = len(times)
    if ddp:  # every rank joins every step's all-reduce, with an equal share
        rounds_in, samples, members_sum = np.full(n_nodes, float(n)), np.ones(n_nodes), n_nodes * n
    extrapolated = n < per_epoch * epochs
    epoch_s = math.fsum(times) / n * per_epoch if extrapolated else math.fsum(times) / epochs
    return ModeResult(
        mode=mode,
        workers=n_nodes,
        shards=1 if ddp else cluster.shards,
        rounds=n,
        round_s=math.fsum(times) / n,
        epoch_s=epoch_s,
        extrapolated=extrapolated,
        idle_share=idle / busy if busy > 0 else 0.0,
        comm_s=comm / n,
        members=members_sum / n,
        worker_link_bytes=ring_bytes if ddp else worker_bytes / n,
        server_link_bytes=server_bytes / n,
        ring_s=_ring_s(cluster),
        groups=group_stats(cluster, rounds_in, samples, n),
    )


def _async(cluster: Cluster, epochs: int, max_rounds: int | None, seed: int) -> ModeResult:
    nodes = cluster.nodes
    n = len(nodes)
    jitter = Jitter(cluster, seed)
    plan = async_batches(_speeds(cluster), cluster.global_batch)
    batch = np.array([plan[i] for i in range(n)])
    one_way = np.array([one_way_s(cluster, node) for node in nodes])
    # a node fitted from a run has its CPU time for the wire in its measured push time
    wire_cpu = cpu_stretch(cluster, n) * worker_cpu_s(cluster)
    one_way += np.array([0.0 if node.push_s is not None else wire_cpu / 2 for node in nodes])
    cost = [push_cost_s(cluster, node) for node in nodes]
    f = staleness_function(cluster.staleness)
    target = cluster.samples * epochs
    pushes_cap = None if max_rounds is None else max_rounds * n
    based_on = np.zeros(n, dtype=np.int64)
    idx = np.arange(n)
    first = one_way + jitter.compute(idx, batch) + one_way  # pull, compute, push
    heap = [(float(t), i) for i, t in enumerate(first)]
    heapq.heapify(heap)
    server_free = 0.0
    version = applied = rejected = 0
    taus: collections.Counter[int] = collections.Counter()
    lr_sum = 0.0
    samples = np.zeros(n)
    end = 0.0
    while heap and applied < target and (pushes_cap is None or version + rejected < pushes_cap):
        arrive, i = heapq.heappop(heap)
        start = max(server_free, arrive)
        server_free = end = start + cost[i]
        tau = version - int(based_on[i])
        if too_stale(tau, cluster.max_staleness):
            rejected += 1
        else:
            version += 1
            applied += int(batch[i])
            samples[i] += batch[i]
            taus[tau] += 1
            lr_sum += lr_scale(f, tau, int(batch[i]), cluster.global_batch)
        based_on[i] = version  # the reply (or the re-pull) carries the current parameters
        step = float(jitter.compute(idx[i : i + 1], batch[i : i + 1])[0])
        heapq.heappush(heap, (end + one_way[i] + step + one_way[i], i))
    per_batch = end / max(applied, 1) * cluster.global_batch
    whole = applied >= target
    epoch_s = end / epochs if whole else end / max(applied, 1) * cluster.samples
    pushes_per_batch = version / max(applied, 1) * cluster.global_batch
    mean_tau = sum(t * c for t, c in taus.items()) / max(version, 1)
    return ModeResult(
        mode="async",
        workers=n,
        shards=cluster.shards,
        rounds=version + rejected,
        round_s=per_batch,
        epoch_s=epoch_s,
        extrapolated=not whole,
        worker_link_bytes=2 * cluster.wire_bytes,  # per push: parameters in, gradient out
        server_link_bytes=2 * cluster.wire_bytes / cluster.shards * pushes_per_batch,
        ring_s=_ring_s(cluster),
        staleness={
            "mean": mean_tau,
            "max": max(taus, default=0),
            "histogram": {str(t): c for t, c in sorted(taus.items())},
        },
        rejected=rejected,
        lr_factor_mean=lr_sum / max(version, 1),
        groups=group_stats(cluster, None, samples, version),
    )
