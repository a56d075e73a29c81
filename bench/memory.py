"""Peak memory of large data, step by step: a ~2 GB dataset converted and served, a large
GeoTIFF scene prepared and predicted, or the coordinator serving a file larger than its cache.

Each step runs in a fresh interpreter that reports its own peak resident set size, so the steps
do not inherit each other's peaks. Prediction uses a tiny model (one 1x1 convolution) behind
the real ``RawInput`` wrapper, so the figures are those of the streaming pipeline. The
``coordinator`` kind runs ``pserver start`` (weighted-sync, ``--cache-mb``) on synthetic scenes
with workers pulling their samples, then the final evaluation on the whole test split, and
reads the server's peak every 0.2 s until it exits; one worker by default, whose rounds do not
depend on measured speeds, so a ``--baseline`` checkout trains the same model.
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
from bench.harness.served import served_run
from common.data.convert.synth import synth_scenes
from launch.procs import new_events

STEP_TIMEOUT_S = 3600.0
SAMPLE_S = 0.2
KINDS = ("dataset", "scene", "coordinator")
Row = tuple[str, dict[str, float]]
PEAK = """
import json, sys
from pathlib import Path
from common.procs import peak_rss_bytes
def peak_mb():
    return peak_rss_bytes() / 2**20
folder, args = Path(sys.argv[1]), json.loads(sys.argv[2])
"""
MODEL = """
import numpy as np, torch
from common.data.convert.cube import open_cube
from common.data.convert.raster import ArrayCube
from pserver.outputs.export import RawInput
from pserver.outputs.model_file import LoadedModel
from pserver.outputs.predict import predict_scene
bands = args["bands"]
net = torch.nn.Sequential(
    torch.nn.Conv2d(bands, 4, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
)
module = RawInput(net, np.zeros(bands), std=np.ones(bands)).eval()
meta = {"kind": "hsi", "bands": bands, "patch": 5, "class_names": list("abcd")}
model = LoadedModel(Path("tiny"), meta, module, torch.device("cpu"))
"""
STEPS = {
    "dataset": {
        "convert": """
from common.data.convert.synth import synth_scenes
base = peak_mb()
synth_scenes(folder / "scenes.h5", classes=10, seed=0, **args)
""",
        "serve": """
import numpy as np
from common.data.dataset import DatasetReader
base = peak_mb()
rng = np.random.default_rng(0)
seen = 0
with DatasetReader(folder / "scenes.h5", cache_bytes=0) as reader:
    while seen < reader.meta.num_samples:
        x, y = reader.read(rng.choice(reader.train_indices, 256))
        seen += len(y)
""",
        "evaluate": """
from common.data.dataset import DatasetReader
base = peak_mb()
with DatasetReader(folder / "scenes.h5", cache_bytes=0) as reader:
    for x, y in reader.iter_blocks(reader.test_indices, 512):
        pass
""",
    },
    "scene": {
        "prepare": """
from common.data.convert.hsi import prepare_hsi
base = peak_mb()
prepare_hsi(str(folder / "cube.tif"), str(folder / "gt.tif"), folder / "out.h5", patch=5)
""",
        "predict, windowed": MODEL
        + """
base = peak_mb()
with open_cube(str(folder / "cube.tif")) as cube:
    classes = predict_scene(model, cube, batch=1024, progress=False)
""",
        "predict, whole": MODEL
        + """
base = peak_mb()
with open_cube(str(folder / "cube.tif")) as cube:
    whole = ArrayCube(cube.read_rows(0, cube.shape[0]), "whole")
classes = predict_scene(model, whole, batch=1024, progress=False)
""",
    },
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


def peak_mib(pid: int) -> float:
    """The peak resident set size (``VmHWM``) of a running process so far, in MiB.

    Raises:
        OSError, RuntimeError: the process is gone.
    """
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def run_step(kind: str, step: str, folder: Path, args: dict[str, int]) -> dict[str, float]:
    """Run one step in a fresh interpreter.

    Args:
        kind: ``dataset`` or ``scene``.
        step: a step of ``STEPS[kind]``.
        folder: where the step's files are.
        args: the data's sizes (``synth_scenes`` arguments; the scene's bands).

    Returns:
        ``{"base_mb", "peak_mb", "s"}`` (seconds).

    Raises:
        RuntimeError: the child failed.
    """
    code = PEAK + STEPS[kind][step] + '\nprint(json.dumps({"base_mb": base, "peak_mb": peak_mb()}))'
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", code, str(folder), json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    if res.returncode != 0:
        raise RuntimeError(f"step {step} failed:\n{res.stderr[-3000:]}")
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    stats["s"] = time.perf_counter() - start
    return stats


def serve(data: Path, run_dir: Path, code: Path, opts: argparse.Namespace) -> list[Row]:
    """One job of ``pserver start`` and its workers, every process importing ``code``.

    Returns:
        The server's peak until the last round (once reached) and over the run (with the
        summary's final OA), each above its peak when it began to listen.
    """
    options = [
        *("--dataset", str(data), "--model", opts.model, "--mode", "weighted-sync"),
        *("--workers", str(opts.workers), "--global-batch", str(opts.batch * opts.workers)),
        *("--max-steps", str(opts.steps), "--cache-mb", str(opts.cache_mb), "--seed", "1"),
        *("--shutdown-timeout", "900"),  # the final evaluation runs within it
    ]
    rows: list[Row] = []
    start = time.perf_counter()
    with served_run(
        code, run_dir, options, opts.workers, start_timeout_s=300, stop_grace_s=120
    ) as run:
        base = peak = peak_mib(run.server.pid)
        while run.server.code is None:
            try:
                peak = peak_mib(run.server.pid)
            except (OSError, RuntimeError):
                break
            events = new_events(run.metrics, run.mark)
            if not rows and sum(e.get("event") == "round" for e in events) >= opts.steps:
                seconds = time.perf_counter() - start
                rows.append(("serve, training", {"base_mb": base, "peak_mb": peak, "s": seconds}))
            time.sleep(SAMPLE_S)
    final = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["final"] or {}
    seconds = time.perf_counter() - start
    whole = {"base_mb": base, "peak_mb": peak, "s": seconds, "final_oa": final.get("oa", -1.0)}
    return [*rows, ("serve, whole run", whole)]


def measure(kind: str, opts: argparse.Namespace, folder: Path) -> None:
    """Write the data of ``kind`` into ``folder``, run its steps and print their peaks."""
    if kind == "scene":
        args = {"bands": opts.bands or 64}
        write_scene(folder, opts.rows, opts.cols, args["bands"])
        print(f"scene: {opts.rows} x {opts.cols} x {args['bands']} uint16 GeoTIFF")
    else:
        samples = opts.samples or (9800 if kind == "dataset" else 8000)
        args = {"samples": samples, "bands": opts.bands or 13, "size": opts.size}
        if kind == "dataset" or opts.data is None:
            print(f"{kind}: {samples} images of {args['bands']}x{opts.size}x{opts.size} float32")
    data = opts.data if kind == "coordinator" and opts.data else folder / "scenes.h5"
    if kind != "coordinator":
        rows = [(step, run_step(kind, step, folder, args)) for step in STEPS[kind]]
    else:
        if not data.exists():
            synth_scenes(data, classes=10, seed=0, **args)
        print(f"{data.name} served with --cache-mb {opts.cache_mb}, {opts.model}")
        rows = serve(data, folder / "run", ROOT, opts)
        if opts.baseline is not None:
            ran = serve(data, folder / "baseline", opts.baseline.resolve(), opts)
            rows += [(f"baseline {step}", stats) for step, stats in ran]
    if kind == "scene":  # the cube as float32
        data_mb = opts.rows * opts.cols * args["bands"] * 4 / 2**20
    else:  # the file as written
        data_mb = data.stat().st_size / 2**20
    print(f"data: {data_mb:.0f} MiB")
    print(f"{'step':<30}{'peak RSS MiB':>14}{'above start MiB':>17}{'peak/data':>11}{'s':>8}")
    for step, s in rows:
        above, ratio = s["peak_mb"] - s["base_mb"], s["peak_mb"] / data_mb
        print(f"{step:<30}{s['peak_mb']:>14.0f}{above:>17.0f}{ratio:>11.3f}{s['s']:>8.1f}")
    for step, s in rows:
        name = step.replace(", ", "_").replace(" ", "_")
        print(f"{name}_peak_mib={s['peak_mb']:.0f}")
        if "final_oa" in s:
            print(f"{name}_final_oa={s['final_oa']:.6f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--kinds", default="dataset", help="dataset, scene and/or coordinator (default dataset)")
    add("--samples", type=int, help="images (default 9800 in a dataset, 8000 for the coordinator)")
    add("--bands", type=int, help="bands (default 13 in a dataset, 64 in a scene)")
    add("--size", type=int, default=64, help="dataset: image side (default 64)")
    add("--rows", type=int, default=1200, help="scene: rows (default 1200)")
    add("--cols", type=int, default=1200, help="scene: columns (default 1200)")
    add("--model", default="scene-cnn", help="coordinator: model (scene-cnn)")
    add("--cache-mb", type=int, default=256, help="coordinator: --cache-mb (256)")
    add("--workers", type=int, default=1, help="coordinator: workers (default 1)")
    add("--batch", type=int, default=16, help="coordinator: per worker (16)")
    add("--steps", type=int, default=20, help="coordinator: --max-steps (20)")
    add("--baseline", type=Path, help="coordinator: another checkout, run too")
    add("--data", type=Path, help="coordinator: an existing dataset file")
    add("--dir", type=Path, help="where to write the files")
    opts = parse_settings(parser, argv)
    kinds = opts.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds {opts.kinds!r}: any of {', '.join(KINDS)}")
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix=f"bench-memory-{kind}-", dir=opts.dir) as tmp:
            measure(kind, opts, Path(tmp))
