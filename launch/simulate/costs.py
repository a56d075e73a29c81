"""The cost model: what moving a model over links, summing pushes and stepping shards takes.

Links are full duplex with a rate and a one-way latency. A sharded parameter server splits the
model into K byte-balanced pieces; shard s sits on node s (co-located) or on its own server
host. A synchronous round is: every member pulls the K pieces (each shard's egress sends one
piece per remote member), computes, then pushes K pieces, chunk by chunk as backward finishes
them, so a push can start up to the backward pass before the compute ends (its last chunk
leaves after); each shard takes pieces first come, first served at its ingress rate (or its
decode rate, if slower; pieces that arrive together share the link and finish together), and
steps its piece once the last is in. A piece between a node and the shard on that node does
not touch a link. The protocol's CPU stages (a worker taking parameters in and turning its
gradient into pieces, a shard's update and reply pieces) add to the round; on
``shared_cores`` the stages that several hosts run at once stretch.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from launch.simulate.spec import FP32_BYTES, MB, Cluster, Node


def ring_allreduce_s(nbytes: float, n: int, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """Time of a ring all-reduce: 2(n-1) steps, each moving ``nbytes / n`` over the slowest link.

    Args:
        nbytes: bytes reduced.
        n: ranks.
        bytes_per_s: the slowest link's rate.
        latency_s: one-way latency per step.

    Returns:
        2(n-1)/n * nbytes / bytes_per_s + 2(n-1) * latency_s (0 for one rank).
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bytes_per_s + 2 * (n - 1) * latency_s


def ddp_step_s(cluster: Cluster, compute_s: np.ndarray) -> float:
    """A DDP step: buckets all-reduced in turn as the slowest rank's backward produces them.

    Torch DDP fills ``ddp_bucket_mb`` buckets during the backward pass and starts each one's
    all-reduce when every rank has produced it, so communication overlaps the backward pass
    except for what the last buckets need after it ends.

    Args:
        cluster: the cluster (its slowest link and latency set the ring's pace).
        compute_s: each rank's compute time for the step.

    Returns:
        The step time (the slowest rank's compute and the communication left after it).
    """
    slowest = float(compute_s.max())
    n = len(compute_s)
    nbytes = cluster.wire_bytes
    if cluster.ddp_allreduce_s is not None:  # measured on the cluster itself
        return slowest + cluster.ddp_allreduce_s
    rate = min(node.link_bytes_s for node in cluster.nodes[:n])
    latency = max(node.latency_s for node in cluster.nodes[:n])
    buckets = max(1, math.ceil(nbytes / (cluster.ddp_bucket_mb * MB)))
    backward = slowest * cluster.backward_share
    forward = slowest - backward
    end = 0.0
    for j in range(buckets):
        size = min(cluster.ddp_bucket_mb * MB, nbytes - j * cluster.ddp_bucket_mb * MB)
        ready = forward + backward * (j + 1) / buckets
        end = max(end, ready) + ring_allreduce_s(size, n, rate, latency)
    return max(end, slowest)


@dataclasses.dataclass(frozen=True)
class RoundTimes:
    """One simulated synchronous round.

    Attributes:
        accepted_s: per member, from the round's start to its push being in on every shard.
        round_s: from the start to the end of the shards' steps.
        worker_bytes: per member, bytes its host's link carried (both directions, all roles).
        shard_bytes: per shard, bytes its host's link carried for it.
    """

    accepted_s: np.ndarray
    round_s: float
    worker_bytes: np.ndarray
    shard_bytes: np.ndarray


class ShardedRound:
    """Times a synchronous round of a sharded parameter server over the cluster's links.

    Args:
        cluster: the cluster.
        members: indices into ``cluster.nodes`` of the round's members.
    """

    def __init__(self, cluster: Cluster, members: np.ndarray) -> None:
        nodes = cluster.nodes
        k = cluster.shards
        self.piece = cluster.wire_bytes / k
        m = len(members)
        rate = np.array([nodes[i].link_bytes_s for i in members])
        lat = np.array([nodes[i].latency_s for i in members])
        if cluster.colocated:
            shard_rate = np.array([nodes[s].link_bytes_s for s in range(k)])
            shard_lat = np.array([nodes[s].latency_s for s in range(k)])
            local = members[None, :] == np.arange(k)[:, None]  # (k, m): piece stays on host
        else:
            shard_rate = np.full(k, cluster.server_link_bytes_s)
            shard_lat = np.full(k, cluster.server_latency_s)
            local = np.zeros((k, m), dtype=bool)
        self.remote = ~local
        self.member_bytes = self.remote.sum(axis=0) * self.piece  # per member, each way
        # a shard's egress sends one piece to each remote member: the pull ends when it has
        pull_egress = self.remote.sum(axis=1) * self.piece / shard_rate
        self.pull_s = (
            np.maximum(self.member_bytes / rate, pull_egress.max()) + lat + shard_lat.max()
        )
        self.lat = lat
        self.send_s = self.member_bytes / rate + lat  # a member's pieces leave in parallel
        # a push's last chunk leaves after backward ends
        self.last_chunk_s = np.minimum(cluster.chunk_mb * MB, self.member_bytes) / rate + lat
        self.backward_share = cluster.backward_share
        shards_busy, members_busy = cpu_stretch(cluster, k), cpu_stretch(cluster, m)
        decode = cluster.server.decode_s_per_byte * self.piece * shards_busy
        self.cost = np.maximum(np.where(self.remote, self.piece / shard_rate[:, None], 0.0), decode)
        # after the last piece: sum, step, and the reply pieces of the new version, on every
        # shard at once; a member takes the pulled parameters in before it computes and turns
        # its gradient into pieces after
        self.step_s = shard_step_s(cluster, m)
        self.worker_cpu_s = members_busy * worker_cpu_s(cluster)
        self.shard_bytes = 2 * self.remote.sum(axis=1) * self.piece
        # a host that holds a shard also carries its traffic
        self.worker_bytes = 2 * self.member_bytes + (local * self.shard_bytes[:, None]).sum(axis=0)

    def times(self, compute_s: np.ndarray, transfer_s: np.ndarray) -> RoundTimes:
        """Time a round in which member j computes ``compute_s[j]``.

        Args:
            compute_s: per member compute time.
            transfer_s: per member measured time outside compute (NaN: use the link model).

        Returns:
            The round's times.
        """
        measured = ~np.isnan(transfer_s)
        computed = self.pull_s + self.worker_cpu_s + compute_s  # (m,)
        accepted = self._accepted(computed)
        if self.backward_share > 0:
            # chunks leave as backward finishes them: a push starts up to the backward pass
            # before the compute ends, but no earlier than its duration (over its own link or
            # the busiest shard's) less its last chunk, which leaves after the compute
            push_s = accepted - computed
            lead = np.minimum(
                self.backward_share * compute_s, np.maximum(push_s - self.last_chunk_s, 0.0)
            )
            if lead.any():
                accepted = np.maximum(self._accepted(computed - lead), computed + self.last_chunk_s)
        accepted = np.where(measured, compute_s + np.nan_to_num(transfer_s), accepted)
        return RoundTimes(
            accepted_s=accepted,
            round_s=float(accepted.max()) + self.step_s,
            worker_bytes=self.worker_bytes,
            shard_bytes=self.shard_bytes,
        )

    def _accepted(self, ready: np.ndarray) -> np.ndarray:
        """When each member's push is in on every shard, if member j starts it at
        ``ready[j]``: each shard takes pieces first come, first served."""
        arrive = ready + self.lat  # pieces stream in from here, at the slower end's rate
        order = np.argsort(arrive, kind="stable")
        cost = self.cost[:, order]  # (k, m) in arrival order
        cum = np.cumsum(cost, axis=1)
        # first come, first served: done_j = max(done_{j-1}, arrive_j) + cost_j
        done_sorted = cum + np.maximum.accumulate(arrive[order][None, :] - (cum - cost), axis=1)
        # pieces that arrive together share the link fairly and finish together
        arrived = arrive[order]
        starts = np.flatnonzero(np.r_[True, np.diff(arrived) > 1e-12 * (1 + arrived[1:])])
        group_end = np.maximum.reduceat(done_sorted, starts, axis=1)
        done_sorted = np.repeat(group_end, np.diff(np.r_[starts, len(arrived)]), axis=1)
        done = np.empty_like(done_sorted)
        done[:, order] = done_sorted
        return np.maximum(done.max(axis=0), ready + self.send_s)


def cpu_stretch(cluster: Cluster, busy: int) -> float:
    """How much longer a CPU stage takes when ``busy`` hosts run it at the same time: 1 when
    every host has its own processor, else max(1, busy / shared_cores)."""
    if cluster.shared_cores is None:
        return 1.0
    return max(1.0, busy / cluster.shared_cores)


def worker_cpu_s(cluster: Cluster) -> float:
    """A worker's CPU time per step for the wire: pulled parameters in, its gradient out."""
    server = cluster.server
    return (
        server.worker_decode_s_per_byte * cluster.wire_bytes
        + server.worker_encode_s_per_byte * cluster.model_params * FP32_BYTES
    )


def shard_step_s(cluster: Cluster, gradients: int) -> float:
    """A shard's update from ``gradients`` pushed gradients (sum them, step its slice) and the
    reply pieces of the new version, on every shard at once."""
    server = cluster.server
    slice_bytes = cluster.model_params * FP32_BYTES / cluster.shards
    update = (
        server.step_s
        + server.step_s_per_byte * slice_bytes
        + server.sum_s_per_byte * slice_bytes * max(gradients - 1, 0)
    )
    return cpu_stretch(cluster, cluster.shards) * (update + server.encode_s_per_byte * slice_bytes)


def push_cost_s(cluster: Cluster, node: Node) -> float:
    """Server time to take in and apply one async push of ``node`` (the K shards work in
    parallel). A node fitted from a run brings its measured push time, which holds the
    take-in already: then only the step is charged."""
    if node.push_s is not None:
        return shard_step_s(cluster, 1)
    piece = cluster.wire_bytes / cluster.shards
    take_in = max(piece / cluster.shard_link_bytes_s, cluster.server.decode_s_per_byte * piece)
    return take_in + shard_step_s(cluster, 1)


def one_way_s(cluster: Cluster, node: Node) -> float:
    """Async: one direction of a node's parameter or gradient transfer, without contention."""
    if node.push_s is not None:
        return node.push_s / 2
    return cluster.wire_bytes / node.link_bytes_s + node.latency_s + cluster.server_latency_s
