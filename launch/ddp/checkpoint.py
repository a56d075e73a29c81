"""A DDP run's checkpoints: the replica's state, its optimizer's state and the position in the
data, in the parameter server's checkpoint format (``pserver.checkpoint``: one ``.npz`` of
numeric arrays and a JSON document, written atomically, never pickled).

The position needs no random-number state: epoch e's order is ``default_rng(seed + e)``'s
permutation, so ``epoch`` and ``cursor`` (samples of it done) say where to go on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.training.flat import FlatLayout
from pserver.checkpoint import Checkpoint, write

DIRECTORY = "checkpoints"


def save(
    run_dir: Path, layout: FlatLayout, optimizer: torch.optim.Optimizer, meta: dict[str, Any]
) -> Path:
    """Write the model's flat state, the optimizer's per-parameter state and ``meta`` (which
    holds ``version``, the file's number) to ``run_dir/checkpoints``.

    Returns:
        The file written.

    Raises:
        OSError: it could not be written.
    """
    arrays = {"state": layout.read_state().numpy()}
    for index, slots in optimizer.state_dict()["state"].items():
        for name, value in slots.items():
            if value is not None:
                arrays[f"opt/{index}/{name}"] = torch.as_tensor(value).detach().cpu().numpy()
    return write(run_dir / DIRECTORY, Checkpoint(arrays, meta))


def restore(saved: Checkpoint, layout: FlatLayout, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint ``save`` wrote into the model and the optimizer.

    Raises:
        ValueError: the state does not fit the model.
    """
    layout.write_state(saved.arrays["state"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in saved.arrays.items():
        if key.startswith("opt/"):
            _, index, name = key.split("/")
            state.setdefault(int(index), {})[name] = torch.from_numpy(value.copy())
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
