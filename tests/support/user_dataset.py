"""A user's own ``torch.utils.data.Dataset`` module, written to a folder and importable."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

MODULE = textwrap.dedent(
    """
    import numpy as np
    import torch


    class Stripes(torch.utils.data.Dataset):
        \"\"\"Images of horizontal stripes, vertical stripes or plain noise (0..255 values).\"\"\"

        classes = ["horizontal", "vertical", "plain"]

        def __init__(self, n=240, size=16, bands=3, seed=0):
            self.n, self.size, self.bands, self.seed = n, size, bands, seed
            self.labels = np.random.default_rng(seed).integers(0, 3, n)

        def __len__(self):
            return self.n

        def image(self, i):
            rng = np.random.default_rng([self.seed, i])
            x = rng.integers(60, 120, size=(self.bands, self.size, self.size)).astype(np.float32)
            stripes = (np.arange(self.size) // 2 % 2 == 0) * 100.0
            label = int(self.labels[i])
            if label == 0:
                x += stripes[None, :, None]
            elif label == 1:
                x += stripes[None, None, :]
            return x, label

        def __getitem__(self, i):
            x, label = self.image(i)
            return {"image": torch.from_numpy(x), "label": torch.tensor(label)}


    class Tuples(Stripes):
        classes = None

        def __getitem__(self, i):
            return self.image(i)


    class Jittery(Stripes):
        def __getitem__(self, i):
            x, label = self.image(i)
            return {"image": torch.from_numpy(x + np.random.rand()), "label": label}


    class Masks(Stripes):
        def __getitem__(self, i):
            return {"image": torch.zeros(3, 4, 4), "mask": torch.zeros(4, 4)}
    """
)


def importable_user_module(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Write ``MODULE`` as ``user_stripes_<n>`` in ``directory``, importable until the generator
    ends; yields its name."""
    name = f"user_stripes_{abs(hash(directory)) % 10**8}"
    (directory / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(directory))
    yield name
    sys.modules.pop(name, None)
