"""Peak memory of preparing and predicting a large GeoTIFF scene, read in windows or whole.

Writes a synthetic ROWS x COLS x BANDS uint16 GeoTIFF (in row blocks) and a sparse class map,
then runs each step in a fresh interpreter that reports its own peak resident set size
(``getrusage``):

1. prepare: ``prepare_hsi`` from the GeoTIFF cube and class map (5 x 5 patches);
2. predict, windowed: ``predict_scene`` on the GeoTIFF, a band of rows at a time;
3. predict, whole: the same on the cube loaded into memory first (what a .mat cube costs).

Prediction uses a tiny model (one 1x1 convolution) behind the real ``RawInput`` wrapper, so
the figures are those of the streaming pipeline, not of a network. Prints peak RSS, peak minus
the interpreter's start-up, that over the cube's float32 size, and time; deletes the files.

Usage: python -m bench scene-memory [--rows 1200] [--cols 1200] [--bands 64] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import ROOT
from bench.harness.record import parse_settings

PEAK = """
import json, sys, time
from pathlib import Path
from common.procs import peak_rss_bytes
def peak_mb():
    return peak_rss_bytes() / 2**20
"""

MODEL = """
import numpy as np, torch
from pathlib import Path
from common.data.convert.cube import ArrayCube, open_cube
from pserver.outputs.export import RawInput
from pserver.outputs.model_file import LoadedModel
from pserver.outputs.predict import predict_scene
bands = json.loads(sys.argv[2])["bands"]
net = torch.nn.Sequential(
    torch.nn.Conv2d(bands, 4, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
)
module = RawInput(net, np.zeros(bands), np.ones(bands)).eval()
meta = {"kind": "hsi", "bands": bands, "patch": 5, "class_names": list("abcd")}
model = LoadedModel(Path("tiny"), meta, module, torch.device("cpu"))
"""

STEPS = {
    "prepare": """
from common.data.convert.hsi import prepare_hsi
base = peak_mb()
folder = Path(sys.argv[1])
prepare_hsi(str(folder / "cube.tif"), str(folder / "gt.tif"), folder / "out.h5", patch=5)
""",
    "predict, windowed": MODEL
    + """
base = peak_mb()
with open_cube(str(Path(sys.argv[1]) / "cube.tif")) as cube:
    classes = predict_scene(model, cube, batch=1024, progress=False)
""",
    "predict, whole": MODEL
    + """
base = peak_mb()
with open_cube(str(Path(sys.argv[1]) / "cube.tif")) as cube:
    whole = ArrayCube(cube.read_rows(0, cube.shape[0]), "whole")
classes = predict_scene(model, whole, batch=1024, progress=False)
""",
}


def write_scene(folder: Path, rows: int, cols: int, bands: int) -> None:
    """A uint16 GeoTIFF cube written in row blocks, and a class map labelling 1 % of pixels."""
    import rasterio
    from rasterio.transform import Affine
    from rasterio.windows import Window

    profile = {"driver": "GTiff", "height": rows, "width": cols, "dtype": "uint16"}
    geo = {"crs": "EPSG:32610", "transform": Affine(20.0, 0.0, 5.0e5, 0.0, -20.0, 4.1e6)}
    rng = np.random.default_rng(0)
    step = 64
    with rasterio.open(folder / "cube.tif", "w", count=bands, tiled=True, **profile, **geo) as f:
        for start in range(0, rows, step):
            n = min(step, rows - start)
            block = rng.integers(0, 4000, size=(bands, n, cols), dtype=np.uint16)
            f.write(block, window=Window(0, start, cols, n))
    gt = np.zeros((rows, cols), dtype=np.uint8)
    picked = rng.random((rows, cols)) < 0.01
    quarter = (np.arange(rows) * 4 // rows + 1)[:, None]  # classes 1..4 by row quarter
    gt[picked] = np.broadcast_to(quarter, (rows, cols))[picked]
    with rasterio.open(
        folder / "gt.tif", "w", count=1, **{**profile, "dtype": "uint8"}, **geo
    ) as f:
        f.write(gt, 1)


def run_step(step: str, folder: Path, args: dict[str, int]) -> dict[str, float]:
    """Run one step in a fresh interpreter; returns ``{"base_mb", "peak_mb", "seconds"}``.

    Raises:
        RuntimeError: the child failed.
    """
    code = PEAK + STEPS[step] + '\nprint(json.dumps({"base_mb": base, "peak_mb": peak_mb()}))\n'
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", code, str(folder), json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if res.returncode != 0:
        raise RuntimeError(f"step {step} failed:\n{res.stderr[-3000:]}")
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    stats["seconds"] = time.perf_counter() - start
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1200, help="scene rows (default 1200)")
    parser.add_argument("--cols", type=int, default=1200, help="scene columns (default 1200)")
    parser.add_argument("--bands", type=int, default=64, help="spectral bands (default 64)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files")
    opts = parse_settings(parser, argv)
    args = {"rows": opts.rows, "cols": opts.cols, "bands": opts.bands}
    with tempfile.TemporaryDirectory(prefix="bench-scene-", dir=opts.dir) as tmp:
        folder = Path(tmp)
        write_scene(folder, opts.rows, opts.cols, opts.bands)
        float_mb = opts.rows * opts.cols * opts.bands * 4 / 2**20
        file_mb = (folder / "cube.tif").stat().st_size / 2**20
        print(
            f"scene: {opts.rows} x {opts.cols} x {opts.bands} uint16 GeoTIFF ({file_mb:.0f} MiB; "
            f"{float_mb:.0f} MiB as float32)"
        )
        print(
            f"{'step':<20}{'peak RSS MiB':>14}{'above start MiB':>17}{'/ float32 cube':>16}{'s':>8}"
        )
        for step in STEPS:
            s = run_step(step, folder, args)
            above = s["peak_mb"] - s["base_mb"]
            print(
                f"{step:<20}{s['peak_mb']:>14.0f}{above:>17.0f}{above / float_mb:>16.3f}"
                f"{s['seconds']:>8.1f}"
            )
            print(f"{step.replace(', ', '_').replace(' ', '_')}_peak_mib={s['peak_mb']:.0f}")


if __name__ == "__main__":
    main()
