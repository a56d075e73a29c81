"""Converting and serving data streams: peak memory stays well below the dataset's size.

Each step runs in a fresh subprocess that reports its own peak resident set size
(``getrusage``), so the numbers are not mixed up with pytest's or other children's memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# A synthetic scenes file of about 300 MB: 24000 images of 13 x 16 x 16 float32.
SYNTH = {"samples": 24000, "bands": 13, "size": 16, "classes": 10}

PEAK = """
from common.procs import peak_rss_bytes
def peak_mb():
    return peak_rss_bytes() / 2**20
"""

CONVERT = (
    PEAK
    + """
import json, sys
from common.data.convert.synth import synth_scenes
base = peak_mb()
synth_scenes(sys.argv[1], seed=0, **json.loads(sys.argv[2]))
print(json.dumps({"base_mb": base, "peak_mb": peak_mb()}))
"""
)

SERVE = (
    PEAK
    + """
import json, sys
import numpy as np
from common.data.dataset import DatasetReader
base = peak_mb()
rng = np.random.default_rng(0)
seen = 0
with DatasetReader(sys.argv[1], cache_bytes=0) as reader:
    train = reader.train_indices
    while seen < reader.meta.num_samples:  # as many samples as the file holds, at random
        x, y = reader.read(rng.choice(train, 256))
        assert np.isfinite(x).all()
        seen += len(y)
print(json.dumps({"base_mb": base, "peak_mb": peak_mb(), "samples": seen}))
"""
)

FOLDER = (
    PEAK
    + """
import json, sys
from common.data.convert.folder import prepare_folder
base = peak_mb()
prepare_folder(sys.argv[1], sys.argv[2])
print(json.dumps({"base_mb": base, "peak_mb": peak_mb()}))
"""
)


def run_child(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter and return the JSON it prints last."""
    res = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_synth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """A ~300 MB synthetic scenes file, written by a subprocess; deleted afterwards."""
    path = tmp_path_factory.mktemp("memory") / "scenes.h5"
    stats = run_child(CONVERT, str(path), json.dumps(SYNTH))
    yield path, stats
    path.unlink(missing_ok=True)


def test_converting_synth_scenes_streams(big_synth: tuple[Path, dict]) -> None:
    path, stats = big_synth
    size_mb = path.stat().st_size / 2**20
    assert size_mb > 280
    assert stats["peak_mb"] < size_mb / 2, (stats, size_mb)


def test_serving_without_cache_streams(big_synth: tuple[Path, dict]) -> None:
    path, _ = big_synth
    size_mb = path.stat().st_size / 2**20
    stats = run_child(SERVE, str(path))
    assert stats["samples"] >= SYNTH["samples"]
    assert stats["peak_mb"] < size_mb / 2, (stats, size_mb)
    assert stats["peak_mb"] - stats["base_mb"] < 64, stats  # a few batches, not the file


def test_preparing_a_folder_streams(tmp_path: Path) -> None:
    """1200 uint16 TIFFs of 13 x 64 x 64 (~130 MB) become a ~250 MB float32 dataset."""
    import tifffile

    rng = np.random.default_rng(0)
    root = tmp_path / "eurosat"
    for c in range(4):
        (root / f"class_{c}").mkdir(parents=True)
        block = rng.integers(0, 4000, size=(300, 64, 64, 13), dtype=np.uint16)
        for i, img in enumerate(block):
            path = root / f"class_{c}" / f"img_{i:04d}.tif"
            tifffile.imwrite(path, img, photometric="minisblack", planarconfig="contig")
    out = tmp_path / "folder.h5"
    stats = run_child(FOLDER, str(root), str(out))
    size_mb = out.stat().st_size / 2**20
    out.unlink()
    assert size_mb > 200
    # Growth above the interpreter's baseline is what streaming bounds (two ~32 MB blocks).
    assert stats["peak_mb"] - stats["base_mb"] < size_mb / 3, (stats, size_mb)
