"""The worker's sample cache: kept samples equal fresh reads, and kept tasks are not read again."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from common.data.dataset import DatasetReader
from worker.prefetch import AheadReader


class CountingReader(AheadReader):
    """Reads a real dataset file and records which indices each read asked for."""

    def __init__(self, path: Path, cache_bytes: int) -> None:
        self.reader = DatasetReader(path, cache_bytes=0)
        self.reads: list[list[int]] = []
        super().__init__("test-read", self._count, close=self.reader.close, cache_bytes=cache_bytes)

    def _count(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        self.reads.append(list(indices))
        return self.reader.read(indices)


def _tasks(train: np.ndarray, epochs: int, size: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    tasks = []
    for _ in range(epochs):
        order = [int(i) for i in rng.permutation(train)]
        tasks += [order[k : k + size] for k in range(0, len(order), size)]
    return tasks


@pytest.mark.parametrize("budget_samples", [0, 7, 10**6])
def test_batches_equal_fresh_reads_whatever_the_budget(
    small_hsi: Path, budget_samples: int
) -> None:
    with DatasetReader(small_hsi, cache_bytes=0) as reference:
        train = reference.train_indices
        x0, y0 = reference.read(train[:1])
        row = x0[0].nbytes + y0[0].nbytes
        tasks = _tasks(train, epochs=3, size=13)
        source = CountingReader(small_hsi, budget_samples * row)
        try:
            source.start(tasks[0])
            for k, task in enumerate(tasks):
                x, y = source.get(task)
                want_x, want_y = reference.read(task)
                assert x.numpy().dtype == want_x.dtype and y.numpy().dtype == want_y.dtype
                np.testing.assert_array_equal(x, want_x)
                np.testing.assert_array_equal(y, want_y)
                if k + 1 < len(tasks):
                    source.start(tasks[k + 1])  # as the worker does: the next task, ahead
        finally:
            source.close()
    read = [i for r in source.reads for i in r]
    first_epoch = len(train)
    if budget_samples == 0:
        assert source.cache_hits == 0 and len(read) >= 3 * first_epoch
    elif budget_samples == 7:
        assert len(read) >= 3 * first_epoch - 2 * 7  # at most 7 samples are ever kept
    else:
        assert sorted(read) == sorted(int(i) for i in train)  # each read once, then kept
        assert source.cache_hits == len(tasks) - len(tasks) // 3


def test_an_empty_task_reads_nothing_new(small_hsi: Path) -> None:
    source = CountingReader(small_hsi, 1 << 20)
    try:
        x, y = source.get([])
        assert len(x) == 0 and len(y) == 0
    finally:
        source.close()


def test_tasks_overlapping_kept_samples_read_only_the_others(
    small_hsi: Path,
) -> None:
    with DatasetReader(small_hsi, cache_bytes=0) as reference:
        train = [int(i) for i in reference.train_indices[:12]]
        first, second = train[:8], train[4:12]
        source = CountingReader(small_hsi, 1 << 20)
        try:
            source.start(second)
            # Not the task started: the started read ends and is kept (4..11), so only 0..3
            # are read now, and the started task needs no read at all.
            x1, y1 = source.get(first)
            x, y = source.get(second)
            want_x, want_y = reference.read(second)
            want_x1, want_y1 = reference.read(first)
        finally:
            source.close()
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(x1, want_x1)
    np.testing.assert_array_equal(y1, want_y1)
    assert source.reads == [second, first[:4]]


def test_every_batch_is_made_on_the_reading_thread(small_hsi: Path) -> None:
    with DatasetReader(small_hsi, cache_bytes=0) as reference:
        train = [int(i) for i in reference.train_indices[:12]]
        source = CountingReader(small_hsi, 1 << 20)
        gathered_on: list[str] = []
        try:
            source.get(train)  # every sample kept from here on
            batch = source._cache.batch

            def recording(indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
                gathered_on.append(threading.current_thread().name)
                return batch(indices)

            source._cache.batch = recording  # type: ignore[method-assign]
            ahead, other = train[::-1], train[2:9]
            source.start(ahead)
            x, y = source.get(ahead)
            source.start(ahead)
            x2, y2 = source.get(other)  # not the task started: gathered after it, unused
            want_x, want_y = reference.read(ahead)
            want_x2, want_y2 = reference.read(other)
        finally:
            source.close()
    assert isinstance(x, torch.Tensor) and isinstance(y2, torch.Tensor)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(x2, want_x2)
    np.testing.assert_array_equal(y2, want_y2)
    assert len(gathered_on) == 3 and all(n.startswith("test-read") for n in gathered_on)
    assert len(source.reads) == 1 and source.cache_hits == 2
