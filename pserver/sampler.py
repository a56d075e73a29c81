"""Epoch permutations of the training split, handed out in slices, with exactly-once accounting."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class EpochLedger:
    """What happened to one epoch's samples: handed out, applied, and how often each was."""

    epoch: int
    size: int
    handed_out: int = 0
    applied: int = 0
    uses: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    @property
    def complete(self) -> bool:
        """Every sample of the epoch has been handed out and its update applied."""
        return self.handed_out == self.size and self.applied == self.size


class EpochSampler:
    """Hands out slices of a fresh seeded permutation of the training set each epoch.

    Slices never straddle two epochs. The sampler counts how often each position was applied,
    so the server can prove every sample was used exactly once per epoch.

    Args:
        num_samples: size of the training split.
        seed: base seed; epoch e uses ``seed + e``.
        max_epochs: stop handing out after this many epochs (None: no limit).
    """

    def __init__(self, num_samples: int, seed: int, *, max_epochs: int | None) -> None:
        if num_samples <= 0:
            raise ValueError("the training split is empty")
        self.num_samples, self.seed, self.max_epochs = num_samples, seed, max_epochs
        self.epoch = 0
        self._perm = np.empty(0, dtype=np.int64)
        self._cursor = 0
        self._returned: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.ledgers: dict[int, EpochLedger] = {}
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self._perm = self.permutation(self.epoch)
        self._cursor = 0
        self.ledgers[self.epoch] = EpochLedger(
            self.epoch, self.num_samples, uses=np.zeros(self.num_samples, dtype=np.int32)
        )

    @property
    def cursor(self) -> int:
        """How many positions of the current epoch's permutation were handed out."""
        return self._cursor

    def permutation(self, epoch: int) -> np.ndarray:
        """The (deterministic) order in which epoch ``epoch`` hands out positions."""
        return np.random.default_rng(self.seed + epoch).permutation(self.num_samples)

    def seek(self, epoch: int, cursor: int) -> None:
        """Continue from ``cursor`` in epoch ``epoch`` (restoring a checkpoint); ledgers and
        returned positions are the caller's to restore."""
        self.epoch, self._cursor = epoch, cursor
        self._perm = self.permutation(epoch)
        self.ledgers.clear()
        self._returned.clear()

    @property
    def exhausted(self) -> bool:
        """No more samples will be handed out."""
        return (
            not self._returned
            and self.max_epochs is not None
            and self.epoch >= self.max_epochs
            and self._cursor >= self.num_samples
        )

    def remaining_in_epoch(self) -> int:
        """Samples the next ``take`` can hand out from one epoch (starting a new one if needed)."""
        if self._returned:
            return len(self._returned[0][1])
        if self._cursor >= self.num_samples and not self.exhausted:
            self._next_epoch()
        return self.num_samples - self._cursor

    def take(self, count: int) -> tuple[int, np.ndarray]:
        """Hand out up to ``count`` positions of one epoch, returned ones first.

        Returns:
            ``(epoch, positions)``: positions index the training split; empty when exhausted.
        """
        available = self.remaining_in_epoch()
        n = min(count, available)
        if self._returned:
            epoch, pool = self._returned.popleft()
            out, rest = pool[:n], pool[n:]
            if len(rest):
                self._returned.appendleft((epoch, rest))
        else:
            epoch, out = self.epoch, self._perm[self._cursor : self._cursor + n]
            self._cursor += n
        self.ledgers[epoch].handed_out += n
        return epoch, out

    def give_back(self, epoch: int, positions: np.ndarray) -> None:
        """Return handed-out positions whose update will never arrive (their worker left).

        They are handed out again before anything else, so the epoch still uses each sample
        exactly once.
        """
        if len(positions):
            self._returned.append((epoch, positions))
            self.ledgers[epoch].handed_out -= len(positions)

    def record_applied(self, epoch: int, positions: np.ndarray) -> EpochLedger:
        """Count an applied update over ``positions`` of ``epoch``; returns that epoch's ledger."""
        ledger = self.ledgers[epoch]
        ledger.applied += len(positions)
        np.add.at(ledger.uses, positions, 1)
        return ledger

    def forget(self, epoch: int) -> None:
        """Drop a finished epoch's ledger."""
        self.ledgers.pop(epoch, None)
