"""Evaluation holds a bounded number of bytes of test samples, whatever the batch size, and
scores the same as when it reads the whole split at once."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from common.data.convert.synth import synth_scenes
from common.data.dataset import DatasetReader
from common.training.evaluator import Evaluator, bytes_per_sample
from common.training.flat import FlatLayout
from common.training.metrics import Scores
from common.training.models import build_model

BOUND = 1 << 20  # bytes an evaluation block may take in this test


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 test scenes of 13 x 16 x 16 float32: 5.1 MiB, five times the bound."""
    path = tmp_path_factory.mktemp("evalmem") / "scenes.h5"
    synth_scenes(path, samples=800, bands=13, size=16, classes=4, train_fraction=0.5, seed=3)
    return path


def evaluate_traced(path: Path, block_bytes: int) -> tuple[Scores, int, int]:
    """Score a fixed model on the whole test split; returns the scores, the evaluation's block
    size and the peak bytes numpy and Python allocated meanwhile (tracemalloc)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server evaluates; many threads crawl on busy cores
    try:
        return _evaluate_traced(path, block_bytes)
    finally:
        torch.set_num_threads(threads)


def _evaluate_traced(path: Path, block_bytes: int) -> tuple[Scores, int, int]:
    with DatasetReader(path, cache_bytes=0) as reader:
        shape = reader.meta.shape
        model = build_model("scene-cnn", shape[0], reader.meta.num_classes, shape[1])
        state = FlatLayout(model).read_state().numpy().copy()
        evaluator = Evaluator(
            model, reader, num_classes=reader.meta.num_classes, batch=512, block_bytes=block_bytes
        )
        tracemalloc.start()
        try:
            scores = evaluator.evaluate(state)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return scores, evaluator.batch, peak


def test_evaluation_reads_at_most_the_byte_bound(scenes: Path) -> None:
    bounded, block, peak = evaluate_traced(scenes, BOUND)
    whole, whole_block, whole_peak = evaluate_traced(scenes, 1 << 40)
    split_bytes = 400 * 13 * 16 * 16 * 4
    assert whole_block == 512 and whole_peak > split_bytes  # a count alone: the split at once
    assert 1 <= block < 400
    assert peak <= BOUND, f"evaluation held {peak} bytes, bound {BOUND}"
    assert bounded.confusion == whole.confusion and bounded.oa == whole.oa
    assert bounded.loss == pytest.approx(whole.loss, rel=1e-5)


def test_block_size_follows_the_model_widest_activation(scenes: Path) -> None:
    with DatasetReader(scenes, cache_bytes=0) as reader:
        shape = reader.meta.shape
        model = build_model("scene-cnn", shape[0], 4, shape[1]).eval()
        per_sample = bytes_per_sample(model, shape)
        # scene-cnn's first block: 32 channels at full resolution, three of them alive.
        assert per_sample >= 4 * int(np.prod(shape)) + 3 * 32 * 16 * 16 * 4
        evaluator = Evaluator(model, reader, num_classes=4, batch=512, block_bytes=10 * per_sample)
        assert evaluator.batch == 10
        assert (
            Evaluator(model, reader, num_classes=4, batch=512, block_bytes=1).batch == 1
        )  # one sample at least
