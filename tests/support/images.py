"""Image folders as users have them: multi-band TIFFs in one folder per class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tifffile

CLASSES = ("river", "forest", "annual_crop")  # sorted: annual_crop, forest, river


def make_tiff_folder(root: Path, per_class: int = 5, bands: int = 13, size: int = 8) -> dict:
    """Multi-band uint16 TIFFs, half written planar (bands, rows, cols), half contiguous."""
    rng = np.random.default_rng(0)
    images = {}
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 3000, size=(bands, size, size)).astype(np.uint16) + 1000 * c
            path = root / name / f"{name}_{i}.tif"
            if i % 2:
                tifffile.imwrite(path, img, photometric="minisblack", planarconfig="separate")
            else:
                tifffile.imwrite(
                    path, np.moveaxis(img, 0, -1), photometric="minisblack", planarconfig="contig"
                )
            images[path] = img.astype(np.float32)
    return images
