"""The test scores of the initial model every mode starts from: the curves' t = 0 point."""

from __future__ import annotations

from pathlib import Path

import torch

from common.data.dataset import DatasetReader
from common.training.evaluator import Evaluator
from common.training.flat import FlatLayout
from common.training.models import build_model


def initial_scores(
    dataset: Path, model: str, seed: int, batch: int = 512, progress: bool = False
) -> dict[str, float]:
    """Evaluate the model as the server and every DDP rank initialise it.

    They all call ``torch.manual_seed(seed)`` and then ``build_model``, so with the same seed
    every run of a comparison starts from these parameters.

    Args:
        dataset: the HDF5 dataset.
        model: a built-in model name or ``package.module:factory``.
        seed: the runs' seed.
        batch: evaluation batch size.
        progress: show a progress bar of the evaluation on stderr.

    Returns:
        ``{"oa", "aa", "kappa", "loss"}`` on the whole test split.

    Raises:
        DatasetError, ModelError: the dataset or the model cannot be loaded.
    """
    reader = DatasetReader(dataset)
    try:
        channels, height, _ = reader.meta.shape
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            net = build_model(model, channels, reader.meta.num_classes, height)
        state = FlatLayout(net).read_state().numpy()
        scores = Evaluator(net, reader, num_classes=reader.meta.num_classes, batch=batch).evaluate(
            state, progress=progress
        )
    finally:
        reader.close()
    return {"oa": scores.oa, "aa": scores.aa, "kappa": scores.kappa, "loss": scores.loss}
