"""Per-worker performance model t(b) = alpha + beta*b + c, fitted online and robustly.

``alpha`` is the fixed compute cost of a step, ``beta`` the compute cost per sample and ``c``
the time per round the worker spends outside compute (parameters and gradient on the wire,
data hand-off). Compute pairs ``(batch, seconds)`` come from calibration at join (kept) and
from accepted pushes (a recent window); transfer times from the rounds. Both are fitted by
Huber-weighted least squares, so a few outliers (a stalled step, a GC pause) barely move the
fit, and a lasting change is followed within a few pushes (``Shift``). Absurd input (not
finite, not positive, beyond ``MAX_SECONDS``) is ignored.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence

import numpy as np

MAX_SECONDS = 1e5  # a step or transfer beyond a day is a broken clock, not a measurement
MAX_BATCH = 1 << 24
WINDOW = 32  # recent pushes (and rounds) the fit follows
MAX_CALIBRATION = 16
HUBER_K = 1.345  # residuals beyond this many robust sigmas are down-weighted
IRLS_STEPS = 8
MIN_SPREAD = 0.05  # batch sizes must spread this much (relative) to show a slope
MIN_BETA = 1e-9  # seconds per sample: a slope below this is no slope
TOLERANCE = 1e-6  # relative change at which the reweighting has converged
CHANGE_RUN = 3  # measurements in a row beyond CHANGE_Z sigmas on one side make a change point
CHANGE_Z = 4.0  # robust sigmas of the log ratio measured / predicted
MIN_NOISE = 0.05  # floor of that sigma: changes below about 20 % are left to the window
CHANGE_MIN_POINTS = 8  # measurements a window needs before its scatter is trusted
NOISE_FLOOR_S = 1e-4  # added to both sides of a ratio, so near-zero times do not blow it up
# Compute measurements a server's routine refit waits for (``PerfModel.refresh``): a fit
# costs about a millisecond, and a change point is taken in by the next fit anyway.
REFIT_EVERY = 8


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted model: predicted round time ``alpha_s + beta_s_per_sample * b + transfer_s``.

    Attributes:
        alpha_s: fixed compute cost per step (>= 0).
        beta_s_per_sample: compute cost per sample (> 0).
        transfer_s: time per round outside compute (>= 0).
        proportional: no slope could be fitted (one batch size so far): ``alpha_s`` is 0 and
            ``beta_s_per_sample`` is the mean seconds per sample.
    """

    alpha_s: float
    beta_s_per_sample: float
    transfer_s: float
    proportional: bool = False

    def predict(self, batch: int) -> float:
        """Predicted round time (compute and transfer) for ``batch`` samples."""
        return self.alpha_s + self.beta_s_per_sample * batch + self.transfer_s

    def as_dict(self) -> dict[str, float]:
        """The ``model`` entry of a worker in ``summary.json``."""
        return {
            "alpha_s": round(self.alpha_s, 6),
            "beta_s_per_sample": round(self.beta_s_per_sample, 9),
            "transfer_s": round(self.transfer_s, 6),
        }


def finite(value: object, low: float = -math.inf, high: float = math.inf) -> float | None:
    """``value`` as a float when it is a finite number (not a bool) in [low, high], else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and low <= value <= high else None


def _seconds(value: object) -> float | None:
    return finite(value, 0.0, MAX_SECONDS)


def _batch(value: object) -> int | None:
    number = finite(value, 1, MAX_BATCH)
    return int(number) if number is not None and number == int(number) else None


def _median(values: np.ndarray) -> float:
    """``np.median`` of a non-empty 1-D array, by partition (a tenth of its cost on a window)."""
    k = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, k)[k])
    part = np.partition(values, (k - 1, k))
    return 0.5 * float(part[k - 1] + part[k])


def _scale(residuals: np.ndarray, floor: float) -> float:
    """Robust sigma of residuals: 1.4826 times their median absolute value."""
    return max(1.4826 * _median(np.abs(residuals)), floor)


def _huber_weights(residuals: np.ndarray, sigma: float) -> np.ndarray:
    """Huber weights: 1 within ``HUBER_K`` sigmas, falling as 1/|r| beyond."""
    return np.minimum(1.0, HUBER_K * sigma / np.maximum(np.abs(residuals), 1e-300))


def robust_location(values: Sequence[float]) -> float:
    """Huber M-estimate of the centre of ``values`` (which must not be empty)."""
    xs = np.asarray(values, dtype=np.float64)
    centre = _median(xs)
    sigma = _scale(xs - centre, 1e-6 * abs(centre) + 1e-12)
    for _ in range(IRLS_STEPS):
        weights = _huber_weights(xs - centre, sigma)
        updated = float(weights @ xs / weights.sum())
        if abs(updated - centre) <= TOLERANCE * abs(centre) + 1e-12:
            return updated
        centre = updated
    return centre


def robust_line(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Huber-weighted least-squares line ``t = alpha + beta * b`` through ``points``.

    Returns:
        ``(alpha, beta)`` with alpha >= 0 and beta > 0 (a negative intercept is refitted
        through the origin), or None when the batch sizes do not spread enough to show a
        slope, or the slope is not positive.
    """
    if len(points) < 2:
        return None
    data = np.asarray(points, dtype=np.float64)
    bs, ts = data[:, 0], data[:, 1]
    if bs.max() - bs.min() < MIN_SPREAD * bs.max():
        return None
    # Start from the Theil-Sen line (median of pairwise slopes): robust, so the residual
    # scale taken from it holds for every reweighting step.
    db, dt = bs[:, None] - bs[None, :], ts[:, None] - ts[None, :]
    distinct = db > 0
    beta = _median(dt[distinct] / db[distinct])
    alpha = _median(ts - beta * bs)
    sigma = _scale(ts - alpha - beta * bs, 1e-6 * _median(ts) + 1e-12)
    weights = _huber_weights(ts - alpha - beta * bs, sigma)
    for _ in range(IRLS_STEPS):
        sw = weights.sum()
        mb, mt = weights @ bs / sw, weights @ ts / sw
        sbb = weights @ (bs - mb) ** 2
        if sbb <= 0:  # the weights left a single batch size
            return None
        new_beta = float(weights @ ((bs - mb) * (ts - mt)) / sbb)
        new_alpha = float(mt - new_beta * mb)
        done = abs(new_beta - beta) <= TOLERANCE * abs(new_beta) and abs(
            new_alpha - alpha
        ) <= TOLERANCE * (abs(new_alpha) + abs(new_beta) * mb)
        alpha, beta = new_alpha, new_beta
        if done:
            break
        weights = _huber_weights(ts - alpha - beta * bs, sigma)
    if alpha < 0:  # fixed cost cannot be negative: the best line through the origin
        beta = float(weights @ (bs * ts) / (weights @ (bs * bs)))
        alpha = 0.0
    if not (math.isfinite(alpha) and math.isfinite(beta)) or beta < MIN_BETA:
        return None
    return alpha, beta


def log_ratio(measured_s: float, predicted_s: float) -> float:
    """ln(measured / predicted) of one measurement, both lifted by ``NOISE_FLOOR_S``: what
    ``log_ratios`` gives for it (to the last bit where numpy's log is the C library's),
    without numpy's cost per call."""
    ratio = (measured_s + NOISE_FLOOR_S) / (max(predicted_s, 0.0) + NOISE_FLOOR_S)
    return math.log(ratio) if ratio > 0 else float(np.log(ratio))  # -inf or nan as numpy's


def log_ratios(measured_s: np.ndarray, predicted_s: np.ndarray | float) -> np.ndarray:
    """``log_ratio`` of every measurement of a window and its prediction."""
    return np.log((measured_s + NOISE_FLOOR_S) / (np.maximum(predicted_s, 0.0) + NOISE_FLOOR_S))


class Shift:
    """Change points of a measured series (docs/planner.md): ``CHANGE_RUN`` measurements in a
    row whose ``log_ratio`` to their prediction lies more than ``CHANGE_Z`` sigmas from the
    window's centre, on one side. A lone stalled step never makes one.

    Attributes:
        centre, sigma: the median log ratio of the window to the fit, and 1.4826 x the median
            absolute deviation from it (at least ``MIN_NOISE``; infinite, so nothing is far,
            for fewer than ``CHANGE_MIN_POINTS`` measurements).
        found: change points so far.
    """

    def __init__(self) -> None:
        self.centre, self.sigma, self.found = 0.0, math.inf, 0
        self.run: list[float] = []

    def add(self, measured_s: float, predicted_s: float) -> float | None:
        """One measurement and its prediction (> 0). Returns the factor of the change point it
        completes (the run's median of measured / predicted, over exp(centre)), or None."""
        far = abs(log_ratio(measured_s, predicted_s) - self.centre) > CHANGE_Z * self.sigma
        ratio = measured_s / predicted_s / math.exp(self.centre)
        if not far or (self.run and (ratio > 1) != (self.run[0] > 1)):
            self.run = []
        if far:
            self.run.append(ratio)
        if len(self.run) < CHANGE_RUN:
            return None
        factor, self.run, self.found = statistics.median(self.run), [], self.found + 1
        return factor

    def measure(self, measured_s: np.ndarray, predicted_s: np.ndarray | float) -> None:
        """``centre`` and ``sigma`` from a window and its predictions by the current fit."""
        ratios = log_ratios(measured_s, predicted_s)
        self.centre = _median(ratios)
        few = len(ratios) < CHANGE_MIN_POINTS
        self.sigma = math.inf if few else _scale(ratios - self.centre, MIN_NOISE)


class PerfModel:
    """One worker's model, refitted on demand after new measurements.

    A change point of its compute or transfer times (``Shift``, against the last fit) scales
    the series' older measurements (and the calibration, keeping the slope's shape) by its
    factor; the next fit, even ``fit(refit=False)``, follows at once.

    Args:
        window: recent pushes (and transfer times) the fit follows.
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.calibration: list[tuple[int, float]] = []
        self.compute: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.transfer: collections.deque[float] = collections.deque(maxlen=window)
        self.compute_shift, self.transfer_shift = Shift(), Shift()
        self._fit: Fit | None = None
        self._dirty = False
        self._changed = False
        self._pending = 0  # compute measurements since the last fit

    def seed(self, batches: Iterable[object], seconds: Iterable[object]) -> int:
        """Calibration pairs from join: kept for good (they carry the slope).

        Returns:
            How many pairs were usable (absurd ones are skipped).
        """
        pairs = [
            (b, s)
            for b, s in ((_batch(b), _seconds(s)) for b, s in zip(batches, seconds, strict=False))
            if b is not None and s is not None and s > 0
        ]
        self.calibration = pairs[:MAX_CALIBRATION]
        self._dirty = True
        return len(self.calibration)

    def add_compute(self, batch: object, seconds: object) -> bool:
        """One accepted push: its batch and compute seconds. Returns whether it was usable."""
        b, s = _batch(batch), _seconds(seconds)
        if b is None or s is None or s <= 0:
            return False
        self.compute.append((b, s))
        self._pending += 1
        if self._fit is not None:
            predicted = self._fit.alpha_s + self._fit.beta_s_per_sample * b
            factor = self.compute_shift.add(s, predicted)
            if factor is not None:  # the run is the new level: the rest is scaled to it
                self.calibration = [(cb, ct * factor) for cb, ct in self.calibration]
                for i in range(len(self.compute) - CHANGE_RUN):
                    self.compute[i] = (self.compute[i][0], self.compute[i][1] * factor)
                self._changed = True
        self._dirty = True
        return True

    def add_transfer(self, seconds: object) -> bool:
        """One round's time outside compute. Returns whether it was usable."""
        s = _seconds(seconds)
        if s is None:
            return False
        self.transfer.append(s)
        if self._fit is not None and self._fit.transfer_s > 0:
            factor = self.transfer_shift.add(s, self._fit.transfer_s)
            if factor is not None:
                for i in range(len(self.transfer) - CHANGE_RUN):
                    self.transfer[i] *= factor
                self._changed = True
        self._dirty = True
        return True

    def fit(self, refit: bool = True) -> Fit | None:
        """The current fit, or None before any compute measurement.

        Args:
            refit: take in the measurements since the last fit; False returns the last fit
                as it is (refitting only when there is none yet or a change point was
                found), for a plan that must not wait for a refit.
        """
        if self._dirty and (refit or self._fit is None or self._changed):
            self._fit = self._refit()
            self._dirty = self._changed = False
            self._pending = 0
        return self._fit

    def refresh(self) -> Fit | None:
        """The server's routine fit: refitted once ``REFIT_EVERY`` compute measurements came
        in since the last fit (or at once after a change point), else the current one."""
        return self.fit(refit=self._pending >= REFIT_EVERY)

    def _refit(self) -> Fit | None:
        points = [*self.calibration, *self.compute]
        if not points:
            return None
        transfer = max(robust_location(list(self.transfer)) if self.transfer else 0.0, 0.0)
        line = robust_line(points)
        if line is None:  # one batch size: assume time proportional to the batch
            per_sample = robust_location([t / b for b, t in points])
            fit = Fit(0.0, max(per_sample, MIN_BETA), transfer, proportional=True)
        else:
            fit = Fit(line[0], line[1], transfer)
        # the window, filled up with the calibration while it is short
        recent = np.asarray(points[-(self.compute.maxlen or WINDOW) :], dtype=np.float64)
        predicted = fit.alpha_s + fit.beta_s_per_sample * recent[:, 0]
        self.compute_shift.measure(recent[:, 1], predicted)
        if self.transfer:
            self.transfer_shift.measure(np.asarray(self.transfer, dtype=np.float64), transfer)
        return fit


class RoundSpread:
    """How much workers' round times scatter around their predictions *relative to each
    other* within a round: what makes members wait at the barrier under a balanced plan.

    Each round of n >= 2 members with predictions gives n deviations of a member's residual
    (actual - predicted) from the round's mean residual, scaled by sqrt(n / (n - 1)) so they
    estimate one member's spread; a delay every member shares (the server was busy) cancels.
    The spread is the robust sigma of the deviations of the last ``horizon`` rounds, and 0
    while fewer than ``min_rounds`` of those had two members or more: a plan that left one
    member for long goes back to predictions alone and measures the spread again.

    Args:
        horizon: rounds (counted with ``add_round``) whose deviations count.
        min_rounds: measured rounds within the horizon needed for a spread.
    """

    def __init__(self, horizon: int = 4 * WINDOW, min_rounds: int = 8) -> None:
        self.horizon = horizon
        self.min_rounds = min_rounds
        self.round = 0
        self.recent: collections.deque[tuple[int, list[float]]] = collections.deque()
        self._sigma = 0.0

    def add_round(self, actual_s: Sequence[float], predicted_s: Sequence[float]) -> None:
        """One closed round: its members' actual and predicted times (absurd pairs skipped);
        a round with fewer than two usable members only advances the horizon."""
        self.round += 1
        while self.recent and self.recent[0][0] <= self.round - self.horizon:
            self.recent.popleft()
        residuals = [
            a - p
            for a, p in zip(map(_seconds, actual_s), map(_seconds, predicted_s), strict=True)
            if a is not None and p is not None
        ]
        n = len(residuals)
        if n >= 2:
            mean = math.fsum(residuals) / n
            scale = math.sqrt(n / (n - 1))
            self.recent.append((self.round, [(r - mean) * scale for r in residuals]))
        self._sigma = self._measure()

    def sigma_s(self) -> float:
        """The current spread (one standard deviation, seconds), or 0 (see the class)."""
        return self._sigma

    def _measure(self) -> float:
        if len(self.recent) < self.min_rounds:
            return 0.0
        d = np.fromiter(itertools.chain.from_iterable(v for _, v in self.recent), np.float64)
        return _scale(d - _median(d), 0.0)
