"""Evaluation of a parameter snapshot on the test split, run off the event loop."""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from common.data.dataset import DatasetReader
from common.training.flat import FlatLayout
from common.training.metrics import Scores, confusion_matrix, scores_from_confusion
from common.training.runlog import RunLog
from common.training.summary import SCORE_KEYS
from common.training.tables import oa_text

log = logging.getLogger("pserver.server")

# The fields every ``eval`` event carries at least (docs/run-files.md).
EVAL_KEYS = ("event", "t", "version", "epoch", "samples", *SCORE_KEYS)
# What one evaluation block may hold: its samples as read and the widest activations of the
# forward pass. A count alone is no bound: 512 EuroSAT-sized scenes are 109 MiB as read and
# their first convolution's output 268 MiB more.
BLOCK_BYTES = 48 << 20
# Live activations at a forward pass's widest point, in multiples of its largest module
# output: that output, the input it was computed from and a residual shortcut beside them.
LIVE_OUTPUTS = 3


def bytes_per_sample(model: nn.Module, shape: tuple[int, ...]) -> int:
    """What one sample occupies during an evaluation: its float32 input plus ``LIVE_OUTPUTS``
    times the largest output of any module, measured on one zero sample.

    Args:
        model: the model, in eval mode (a forward pass changes no state then).
        shape: one sample's shape (C, H, W).

    Returns:
        Bytes per sample, at least 1.
    """
    largest = 0

    def record(_module: nn.Module, _inputs: object, output: object) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *shape))
    finally:
        for hook in hooks:
            hook.remove()
    return max(1, 4 * math.prod(shape) + LIVE_OUTPUTS * largest)


class Evaluator:
    """Scores snapshots with a private model copy; call ``evaluate`` from one thread at a time.

    Test samples are read and scored in blocks of at most ``batch`` samples and at most
    ``block_bytes`` (samples as read plus activations, see ``bytes_per_sample``), so the
    memory an evaluation takes does not grow with the size of the samples or of the split.

    Args:
        model: a model of the run's architecture (this object keeps it).
        reader: the dataset, read in blocks of test samples.
        num_classes: classes of the dataset.
        batch: evaluation batch size at most.
        block_bytes: bytes one block may take at most (at least one sample per block).
    """

    def __init__(
        self,
        model: nn.Module,
        reader: DatasetReader,
        *,
        num_classes: int,
        batch: int = 512,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.model = model.eval()
        self.layout = FlatLayout(self.model)
        self.reader = reader
        self.num_classes = num_classes
        per_sample = bytes_per_sample(self.model, reader.meta.shape)
        self.batch = max(1, min(batch, block_bytes // per_sample))

    @torch.no_grad()
    def evaluate(
        self, state: np.ndarray, indices: np.ndarray | None = None, progress: bool = False
    ) -> Scores:
        """OA, AA, kappa and mean cross-entropy of ``state`` on ``indices`` (default: the whole
        test split); ``progress`` shows a bar of test samples on stderr."""
        self.layout.write_state(state)
        matrix = np.zeros((self.num_classes, self.num_classes), dtype=np.int64)
        loss_sum, count = 0.0, 0
        test = self.reader.test_indices if indices is None else indices
        bar = tqdm(total=len(test), desc="evaluating", unit="sample", disable=not progress)
        for x, y in self.reader.iter_blocks(test, self.batch):
            bar.update(len(y))
            logits = self.model(torch.from_numpy(x))
            target = torch.from_numpy(y)
            loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += len(y)
            matrix += confusion_matrix(y, logits.argmax(1).numpy(), self.num_classes)
        bar.close()
        return scores_from_confusion(matrix, loss_sum / max(count, 1))


def lower_thread_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to training (Linux: per-thread nice value).

    Evaluation shares the node with workers; at a lower priority it takes longer but no
    longer slows the updates it runs beside.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted
        log.debug("evaluation keeps normal priority: %s", exc)


def record_evaluation(
    run_log: RunLog,
    scores: Scores,
    *,
    version: int,
    epoch: int,
    samples: int,
    eval_s: float,
    t: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Log the ``eval`` event (docs/run-files.md) and the matching progress line.

    The event also carries the per-class ``accuracy`` and ``support`` and the ``confusion``
    matrix, from which the summary's ``per_class`` is built.

    Args:
        run_log: the run's log.
        scores: the evaluation's result.
        t: the event's time (default: now, which keeps the log in time order).
        version, epoch, samples: what was evaluated.
        eval_s: how long the evaluation took.
        extra: more fields for the event.

    Returns:
        The event as recorded.
    """
    record = run_log.event(
        "eval",
        t=t,
        version=version,
        epoch=epoch,
        samples=samples,
        **{key: getattr(scores, key) for key in SCORE_KEYS},
        eval_s=round(eval_s, 4),
        accuracy=list(scores.accuracy),
        support=list(scores.support),
        confusion=[list(row) for row in scores.confusion],
        **extra,
    )
    done = extra.get("epochs_done")
    log.info(
        "version %d (epoch %s): %s AA %.4f kappa %.4f loss %.4f",
        version,
        f"{done:.2f}" if isinstance(done, float) else epoch,
        oa_text(record),
        scores.aa,
        scores.kappa,
        scores.loss,
    )
    return record
