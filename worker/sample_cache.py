"""Training samples a worker already received, kept in one array so a batch is one gather."""

from __future__ import annotations

import numpy as np


class SampleCache:
    """Keeps samples by dataset index, up to a byte budget (the first ones; none evicted).

    The rows live in one preallocated array (pages are only touched as they fill), so the
    batch of a task whose samples are all kept is a single gather, with no read and no thread.

    Args:
        budget_bytes: bytes of samples (x and y) to keep at most; 0 keeps none.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._slot: dict[int, int] = {}
        self._x: np.ndarray | None = None
        self._y: np.ndarray | None = None

    def missing(self, indices: list[int]) -> list[int]:
        """The indices not kept, in order."""
        slot = self._slot
        return [i for i in indices if i not in slot]

    def batch(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The kept samples of ``indices`` (all must be kept), in order, as new arrays."""
        assert self._x is not None and self._y is not None
        slots = np.fromiter((self._slot[i] for i in indices), np.int64, len(indices))
        return self._x[slots], self._y[slots]

    def add(
        self, indices: list[int], x: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Keep the samples ``x``, ``y`` read for ``indices`` while the budget lasts.

        Returns:
            ``x`` and ``y`` as given.
        """
        if self._x is None:
            row = x[0].nbytes + y[0].nbytes if len(indices) else 0
            capacity = self.budget_bytes // row if row else 0
            if capacity == 0:
                return x, y
            self._x = np.empty((capacity, *x.shape[1:]), dtype=x.dtype)
            self._y = np.empty(capacity, dtype=y.dtype)
        assert self._y is not None
        room = len(self._x) - len(self._slot)
        fresh = [(n, i) for n, i in enumerate(indices) if i not in self._slot][:room]
        if fresh:
            first = len(self._slot)
            rows = np.fromiter((n for n, _ in fresh), np.int64, len(fresh))
            self._x[first : first + len(fresh)] = x[rows]
            self._y[first : first + len(fresh)] = y[rows]
            for k, (_, i) in enumerate(fresh):
                self._slot[i] = first + k
        return x, y

    def merge(
        self, indices: list[int], read: list[int], x: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The samples of ``indices``: those of ``read`` from ``x``, ``y``, the rest kept."""
        if len(read) == len(indices):
            return x, y
        assert self._x is not None and self._y is not None
        out_x = np.empty((len(indices), *x.shape[1:]), dtype=x.dtype)
        out_y = np.empty(len(indices), dtype=y.dtype)
        position = {i: n for n, i in enumerate(read)}
        for n, i in enumerate(indices):
            if i in position:
                out_x[n], out_y[n] = x[position[i]], y[position[i]]
            else:
                out_x[n], out_y[n] = self._x[self._slot[i]], self._y[self._slot[i]]
        return out_x, out_y
