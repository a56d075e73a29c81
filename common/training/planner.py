"""Split a global batch over workers: by fitted performance models, or by measured speeds.

The model planner (``plan_by_model``) gives worker i the batch b_i for which every worker's
predicted round time alpha_i + beta_i*b_i + c_i is the same, with sum b_i = B. A worker gets 0
samples when even one sample would make it finish after the round the others finish without
it (alpha_i + beta_i + c_i > T without i); the caller re-probes such a worker now and then.

Round times scatter around their predictions (a busy core, a GC pause), and a round waits for
its slowest member, so each member adds to the expected round time: with n members whose times
scatter independently by sigma, the round ends about sigma * E[max of n standard normals] after
the predicted time. Given that spread (``spread_s``), the planner drops the member with the
smallest batch while the plan without it is expected to end sooner: a worker whose share
shortens the predicted round by less than the wait it adds sits out (and is re-probed too).

For models with BatchNorm a minimum local batch (``min_batch``, ``at_least``) keeps a
worker's batch statistics from coming from a handful of samples: a worker whose share would
fall below it sits out that round, like a worker planned at 0, and a probe gives it the
minimum, never less.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Collection, Mapping

import numpy as np

from common.training.perfmodel import MAX_SECONDS, Fit, RoundSpread
from common.training.probes import ProbeSchedule


def plan_batches(speeds: dict[int, float], total: int, every_worker: bool = True) -> dict[int, int]:
    """Batch sizes proportional to speed that sum to ``total``.

    Uses largest remainders, and gives every worker at least one sample when
    ``total >= len(speeds)``; otherwise the fastest ``total`` workers get one each.

    Args:
        speeds: worker id -> samples per second (> 0).
        total: the global batch to split (>= 0).
        every_worker: False keeps the largest-remainder split as it is, where a worker may
            get 0 samples.

    Returns:
        worker id -> batch size, summing to ``total`` (ids with 0 samples may be omitted).
    """
    if total <= 0 or not speeds:
        return {}
    order = sorted(speeds, key=lambda w: (-speeds[w], w))
    if every_worker and total < len(order):
        return {w: 1 for w in order[:total]}
    top = speeds[order[0]]
    relative = {w: speeds[w] / top for w in order}  # in (0, 1]: no overflow for any input
    norm = math.fsum(relative.values())
    shares = {w: total * relative[w] / norm for w in order}
    sizes = {w: math.floor(shares[w]) for w in order}
    left = total - sum(sizes.values())
    by_remainder = sorted(order, key=lambda w: (-(shares[w] - sizes[w]), w))
    for w in by_remainder[:left]:
        sizes[w] += 1
    for w in order:  # every worker takes part: lend one sample from the largest batch
        if sizes[w] == 0 and every_worker:
            largest = max(order, key=lambda v: (sizes[v], -v))
            sizes[largest] -= 1
            sizes[w] = 1
    return sizes


def tail_scale(samples: int, global_batch: int) -> float:
    """The weight of a step over ``samples`` when a full step covers ``global_batch``: 1 for a
    full global batch, b / B for an epoch's tail of b samples (its gradient and statistics
    change count as b samples of a global batch, never as a whole one).

    Args:
        samples: samples the step covers (>= 0).
        global_batch: B (>= 1).

    Returns:
        ``min(samples / global_batch, 1)``.
    """
    return min(samples / global_batch, 1.0)


def plan_by_speed(
    speeds: dict[int, float], total: int, probe: Collection[int] = (), min_batch: int = 1
) -> dict[int, int]:
    """``plan_batches``, then ``at_least(min_batch)``; each worker in ``probe`` left at 0
    gets ``min_batch`` samples from the largest batch, if that keeps ``min_batch``.

    Args:
        speeds: worker id -> samples per second (> 0).
        total: the global batch to split (>= 0).
        probe: workers to give ``min_batch`` samples even if the plan gives them none.
        min_batch: the smallest local batch a member may get.

    Returns:
        worker id -> batch size (ids with 0 omitted), summing to ``total``.
    """
    sizes = at_least(
        plan_batches(speeds, total),
        min_batch,
        lambda ws: plan_batches({w: speeds[w] for w in ws}, total),
    )
    give = max(min_batch, 1)
    for w in sorted(probe):
        if w in speeds and sizes and not sizes.get(w):
            donor = max(sizes, key=lambda v: (sizes[v], -v))
            if sizes[donor] - give >= give:
                sizes[donor] -= give
                sizes[w] = give
    return sizes


def async_batches(speeds: dict[int, float], total: int) -> dict[int, int]:
    """Every worker's async batch: its speed's share of ``total``, at least one sample."""
    plan = plan_batches(speeds, total)
    return {w: plan.get(w, 1) for w in speeds}


class WeightedPlanner:
    """weighted-sync's plan of each round, for the server's policy and the cluster simulator:
    ``model`` plans on fitted models (``compute``: without transfer time), weighing the spread
    of round times if ``plan_spread``; ``speed``, and a plan with a worker not yet fitted, by
    speed. Workers below ``min_batch`` sit out; workers at 0 are probed (``ProbeSchedule``)."""

    def __init__(self, *, planner: str = "model", plan_spread: bool = True, min_batch: int = 1):
        self.planner, self.min_batch = planner, min_batch
        self.uses_spread = planner == "model" and plan_spread
        self.probes = ProbeSchedule()
        self.spread = RoundSpread()

    def plan(
        self,
        speeds: dict[int, float],
        fits: Mapping[int, Fit | None],
        total: int,
        recovering: Collection[int] = (),
    ) -> dict[int, int]:
        """The round's plan, worker id -> batch (ids at 0 omitted), summing to ``total``.

        Args:
            speeds: worker id -> samples per second.
            fits: worker id -> fitted model (None: not yet fitted).
            total: the round's samples.
            recovering: workers whose steps ran far faster than predicted: probed at once.
        """
        probe, sizes = self.probes.due(speeds, recovering), None
        fitted = {w: f for w, f in fits.items() if f is not None}
        if self.planner != "speed" and len(fitted) == len(fits):
            if self.planner == "compute":  # the same model without transfer time
                fitted = {w: dataclasses.replace(f, transfer_s=0.0) for w, f in fitted.items()}
            spread = self.spread.sigma_s() if self.uses_spread else 0.0
            sizes = plan_by_model(fitted, total, probe, spread, self.min_batch)
        if sizes is None:
            sizes = plan_by_speed(speeds, total, probe, self.min_batch)
        self.probes.planned(speeds, sizes, probe)
        return sizes


def plan_equal(workers: list[int], total: int) -> dict[int, int]:
    """Equal batch sizes (differing by at most one) that sum to ``total``."""
    return plan_batches({w: 1.0 for w in workers}, total)


def _usable(fit: Fit) -> bool:
    fixed = fit.alpha_s + fit.transfer_s
    return (
        all(math.isfinite(v) for v in (fit.alpha_s, fit.beta_s_per_sample, fit.transfer_s))
        and fit.alpha_s >= 0
        and fit.transfer_s >= 0
        and fixed <= MAX_SECONDS
        and 0 < fit.beta_s_per_sample <= MAX_SECONDS
    )


@functools.cache
def _normal_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The grid ``expected_max_deviate`` integrates on: x, the standard normal's density up
    to its constant, and its distribution function."""
    x = np.linspace(-9.0, 9.0, 3601)
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    return x, np.exp(-0.5 * x * x), cdf


@functools.cache
def expected_max_deviate(n: int) -> float:
    """E[max of n independent standard normal deviates] (0 for n <= 1): 0.564 for 2, 0.846
    for 3, 1.029 for 4."""
    if n <= 1:
        return 0.0
    x, bell, cdf = _normal_grid()
    density = n * bell / math.sqrt(2.0 * math.pi) * cdf ** (n - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


def at_least(
    sizes: dict[int, int], minimum: int, replan: Callable[[list[int]], dict[int, int]]
) -> dict[int, int]:
    """Leave out workers whose batch is below ``minimum``, smallest batch first, re-planning
    the same total over the others, until every batch is at least ``minimum`` or one worker
    is left (it takes the whole total, however small).

    Args:
        sizes: worker id -> batch size (ids with 0 omitted).
        minimum: the smallest local batch worth computing (1: nothing changes).
        replan: members -> their batch sizes for the same total.

    Returns:
        The plan without the workers left out.
    """
    while len(sizes) > 1 and min(sizes.values()) < minimum:
        smallest = min(sizes, key=lambda w: (sizes[w], -w))
        sizes = {w: n for w, n in replan(sorted(w for w in sizes if w != smallest)).items() if n}
    return sizes


def plan_by_model(
    fits: Mapping[int, Fit],
    total: int,
    probe: Collection[int] = (),
    spread_s: float = 0.0,
    min_batch: int = 1,
) -> dict[int, int] | None:
    """Batch sizes that equalise predicted round times, summing to ``total``.

    Continuous sizes come from water-filling (workers whose one-sample time exceeds the
    round time without them get 0, see the module docstring); they are floored and the
    samples left go one at a time to the worker that would then finish first, so the
    predicted round time (the largest) is as small as integers allow. With a ``spread_s``,
    members are then dropped, smallest batch first, while that lowers the expected round time.
    Members whose batch would be below ``min_batch`` sit out (``at_least``).

    Args:
        fits: worker id -> fitted model.
        total: the global batch (>= 0).
        probe: workers to give ``min_batch`` samples even if the plan gives them none (taken
            from the worker predicted to finish last, if it keeps ``min_batch``).
        spread_s: how much round times scatter independently around their predictions (one
            standard deviation, seconds); 0 (or not finite) plans on predictions alone.
        min_batch: the smallest local batch a member may get (BatchNorm models: its batch
            statistics come from the local batch).

    Returns:
        worker id -> batch size (ids with 0 omitted), or None when a model is unusable (not
        finite, negative, or beyond ``MAX_SECONDS``): the caller then plans by speed.
    """
    if not all(_usable(f) for f in fits.values()):
        return None
    if total <= 0 or not fits:
        return {}
    if len(fits) == 1:  # a lone member takes the whole batch, whatever its model
        return {next(iter(fits)): total}
    models = _Models(fits)
    members, batch = models.equal_finish(np.arange(len(models.ids)), total)
    if math.isfinite(spread_s) and 0 < spread_s <= MAX_SECONDS:
        members, batch = models.without_stragglers(members, batch, total, spread_s)
    sizes = dict(zip(models.ids[members].tolist(), batch.tolist(), strict=True))
    sizes = at_least(sizes, min_batch, lambda ws: models.plan_of(ws, total))
    give = max(min_batch, 1)
    for w in sorted(probe):
        if w in fits and not sizes.get(w):
            donor = max(sizes, key=lambda v: (sizes[v] > give, fits[v].predict(sizes[v]), v))
            if sizes[donor] - give >= give:
                sizes[donor] -= give
                sizes[w] = give
    return sizes


# Sums of floats are kept exactly, as integers in units of the smallest subnormal (2**-1074),
# and rounded once (int / int is correctly rounded, as ``math.fsum`` is): the sum over a set
# is then the same float whether summed at once or kept while members are taken out.
_EXACT_SHIFT = 1074
_EXACT_UNIT = 1 << _EXACT_SHIFT


def _exact(values: np.ndarray) -> list[int]:
    """Finite floats as integers in units of 2**-1074."""
    exact = []
    for v in values.tolist():
        numerator, denominator = v.as_integer_ratio()
        exact.append(numerator << (_EXACT_SHIFT - denominator.bit_length() + 1))
    return exact


# Candidates per member for the samples left after flooring; a member whose every candidate is
# taken (not seen in practice: flooring leaves less than one sample per member) falls back to
# handing them out one at a time.
_EXTRA_CANDIDATES = 3


class _Models:
    """Usable fits as arrays, in the order of their one-sample time (then id), so that
    water-filling drops members from the end and a set of members is an ascending array of
    positions. Every time is computed by the same floating-point operations as ``Fit.predict``
    and sums are exact (``_exact``): plans do not depend on the order of ``fits``."""

    def __init__(self, fits: Mapping[int, Fit]) -> None:
        terms = np.array(
            [(f.alpha_s, f.beta_s_per_sample, f.transfer_s) for f in fits.values()],
            dtype=np.float64,
        ).reshape(-1, 3)
        one = terms[:, 0] + terms[:, 1] * 1.0 + terms[:, 2]  # Fit.predict(1)
        ids = np.array(list(fits), dtype=np.int64)
        order = np.lexsort((ids, one))
        self.ids = ids[order]
        self.alpha, self.beta, self.transfer = (terms[order, i] for i in range(3))
        self.one = one[order]
        self.inverse = 1.0 / self.beta
        self.lifted = (self.alpha + self.transfer) / self.beta
        self._exact: tuple[list[int], list[int]] | None = None

    def predict(self, members: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """``Fit.predict`` of each member (positions) for its batch."""
        return self.alpha[members] + self.beta[members] * batch + self.transfer[members]

    def finish_s(self, members: np.ndarray, total: float, sums: tuple[int, int] | None) -> float:
        """T with sum over ``members`` of (T - fixed_i) / beta_i == ``total``, from their
        ``sums`` when given (the same float as summing now)."""
        if sums is not None:
            inverse, lifted = sums
            return (total + lifted / _EXACT_UNIT) / (inverse / _EXACT_UNIT)
        inverse_sum = math.fsum(self.inverse[members].tolist())
        return (total + math.fsum(self.lifted[members].tolist())) / inverse_sum

    def sums(self, members: np.ndarray) -> tuple[int, int]:
        """The exact sums over ``members`` of 1 / beta_i and fixed_i / beta_i (``_exact``)."""
        if self._exact is None:
            self._exact = _exact(self.inverse), _exact(self.lifted)
        inverse, lifted = self._exact
        picked = members.tolist()
        return sum(inverse[p] for p in picked), sum(lifted[p] for p in picked)

    def without(self, sums: tuple[int, int], position: int) -> tuple[int, int]:
        """``sums`` less one member's terms."""
        assert self._exact is not None  # sums() built them
        inverse, lifted = self._exact
        return sums[0] - inverse[position], sums[1] - lifted[position]

    def expected_round_s(self, members: np.ndarray, batch: np.ndarray, spread_s: float) -> float:
        """The predicted round time of a plan plus the expected wait for its slowest member."""
        latest = float(self.predict(members, batch).max())
        return latest + spread_s * expected_max_deviate(len(members))

    def without_stragglers(
        self, members: np.ndarray, batch: np.ndarray, total: int, spread_s: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drop the member with the smallest batch (the slower on a tie) while the plan
        without it has a lower ``expected_round_s``."""
        expected = self.expected_round_s(members, batch, spread_s)
        sums = None  # exact sums over members: built once a member is dropped
        while len(members) > 1:
            # the smallest batch; on a tie the larger one-sample time (then id): the last
            smallest = int(np.flatnonzero(batch == batch.min())[-1])
            rest = None if sums is None else self.without(sums, int(members[smallest]))
            fewer, fewer_batch = self.equal_finish(np.delete(members, smallest), total, rest)
            sooner = self.expected_round_s(fewer, fewer_batch, spread_s)
            if sooner >= expected:
                break
            if rest is None or len(fewer) < len(members) - 1:  # others left out too
                rest = self.sums(fewer)
            members, batch, expected, sums = fewer, fewer_batch, sooner, rest
        return members, batch

    def plan_of(self, workers: list[int], total: int) -> dict[int, int]:
        """``equal_finish`` over the workers with these ids, as worker id -> batch."""
        position = {w: i for i, w in enumerate(self.ids.tolist())}
        members = np.array(sorted(position[w] for w in workers), dtype=np.int64)
        planned, batch = self.equal_finish(members, total)
        return dict(zip(self.ids[planned].tolist(), batch.tolist(), strict=True))

    def equal_finish(
        self, members: np.ndarray, total: int, sums: tuple[int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The plan without spread or probes over ``members`` (ascending positions, at least
        one; ``sums``: their ``sums`` when known) for ``total`` > 0: positions with a batch
        > 0, ascending, and their batches."""
        if total < len(members):  # not enough for everyone: one each to the quickest
            return members[:total], np.ones(total, dtype=np.int64)
        active = len(members)  # members[:active] are planned continuously
        ones: list[int] = []  # positions that keep one sample
        left = total
        finish = self.finish_s(members, left, sums)
        while self.one[members[active - 1]] > finish:  # the slowest's share is below one
            worst = int(members[active - 1])
            if active == 1:  # the last worker planned continuously takes the rest
                break
            active -= 1
            sums = self.without(self.sums(members) if sums is None else sums, worst)
            finish = self.finish_s(members, left, sums)
            if self.one[worst] <= finish:  # one sample keeps it within the others' round
                ones.append(worst)
                left -= 1
                finish = self.finish_s(members, left, sums)
        planned = members[:active]
        share = (finish - self.alpha[planned] - self.transfer[planned]) / self.beta[planned]
        floored = np.clip(np.floor(share + 1e-9), 1, max(left, 1)).astype(np.int64)
        positions = np.concatenate([planned, np.array(ones, dtype=np.int64)])
        batch = np.concatenate([floored, np.ones(len(ones), dtype=np.int64)])
        order = np.argsort(positions, kind="stable")
        positions, batch = positions[order], batch[order]
        for _ in range(int(batch.sum()) - total):  # rounding guard: only through float noise
            batch[self._latest(positions, batch)] -= 1
        batch = self._hand_out(positions, batch, total - int(batch.sum()))
        kept = batch > 0
        return positions[kept], batch[kept]

    def _latest(self, positions: np.ndarray, batch: np.ndarray) -> int:
        """Index of the member predicted to finish last (the larger id on a tie)."""
        times = self.predict(positions, batch)
        tied = np.flatnonzero(times == times.max())
        return int(tied[np.argmax(self.ids[positions[tied]])])

    def _hand_out(self, positions: np.ndarray, batch: np.ndarray, extra: int) -> np.ndarray:
        """Give ``extra`` samples one at a time to the member that would then finish first
        (the smaller id on a tie)."""
        if extra <= 0:
            return batch
        steps = np.arange(1, _EXTRA_CANDIDATES + 1)
        after = batch[:, None] + steps[None, :]  # (members, candidates)
        times = self.predict(positions[:, None], after).ravel()
        if extra <= len(times):
            owner = np.repeat(np.arange(len(positions)), len(steps))
            # the ``extra`` smallest (time, id): every time below the extra-th, then its ties
            kth = np.partition(times, extra - 1)[extra - 1]
            below = np.flatnonzero(times < kth)
            tied = np.flatnonzero(times == kth)
            tied = tied[np.argsort(self.ids[positions][owner[tied]], kind="stable")]
            chosen = np.concatenate([below, tied[: extra - len(below)]])
            taken = np.bincount(owner[chosen], minlength=len(positions))
            if taken.max() < len(steps):
                return batch + taken
        heap = [
            (float(t), int(self.ids[p]), j)
            for j, (p, t) in enumerate(
                zip(positions, self.predict(positions, batch + 1), strict=True)
            )
        ]
        heapq.heapify(heap)
        batch = batch.copy()
        for _ in range(extra):
            _, w, j = heapq.heappop(heap)
            batch[j] += 1
            heapq.heappush(
                heap, (float(self.predict(positions[j : j + 1], batch[j : j + 1] + 1)[0]), w, j)
            )
        return batch
