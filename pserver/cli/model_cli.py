"""``pserver export``, ``predict`` and ``evaluate-snapshots``: use a run's trained model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click
import numpy as np

from common.cli_help import OutFile
from common.errors import PSError

log = logging.getLogger(__name__)

IMAGE_BATCH = 64  # whole images are much larger than pixel patches


def allow_model_option(what: str) -> Any:
    """``--allow-model package.module:factory`` (repeatable): a user model ``what`` may name."""
    return click.option(
        "--allow-model",
        "allow_model",
        multiple=True,
        metavar="package.module:factory",
        help=f"Build this user model when {what} names it (building imports its module; "
        "built-in models need no permission; repeat for several).",
    )


def file_option(flag: str, help: str, out: bool = False, required: bool = False) -> Any:
    """An option naming a file to read (``out``: one to write), optional unless ``required``."""
    kind = OutFile() if out else click.Path(dir_okay=False, path_type=Path)
    optional = {} if required else {"default": None}  # a default makes click skip `required`
    return click.option(flag, type=kind, required=required, help=help, **optional)


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@file_option("--out", "The model file to write (e.g. MODEL.pt).", out=True, required=True)
@file_option("--checkpoint", "Checkpoint to export (default: the newest in RUN_DIR/checkpoints).")
@click.option(
    "--best",
    is_flag=True,
    help="Export the state of the best OA on the whole test split (RUN_DIR/checkpoints/"
    "best.npz, kept by 'pserver start --keep-best') instead of the newest.",
)
@file_option(
    "--dataset", "The run's dataset file (default: the one named in RUN_DIR/summary.json)."
)
@click.option(
    "--format",
    type=click.Choice(["program", "state-dict"]),
    default="program",
    help="program: torch.export program with the normalisation built in, loads with "
    "torch.export.load alone; state-dict: weights for torch.load(weights_only=True).",
)
@allow_model_option("the run")
def export_cmd(run_dir: Path, best: bool, **options: Any) -> None:
    """Export a run's model: raw (unnormalised) C x P x P samples in, class logits out."""
    from pserver.checkpoint import BEST
    from pserver.outputs.export import ExportConfig, export

    if best:
        if options["checkpoint"] is not None:
            raise click.UsageError("give --best or --checkpoint, not both")
        options["checkpoint"] = checkpoint = run_dir / "checkpoints" / BEST
        if not checkpoint.is_file():
            raise click.ClickException(
                f"no {checkpoint}: a run keeps one once an evaluation on the whole test split "
                "is done (pserver start --keep-best, the default)"
            )
    config = ExportConfig(run_dir=run_dir, **options)
    try:
        meta = export(config)
    except PSError as exc:
        raise _fail(exc) from exc
    shape = f"{meta['bands']}x{meta['height']}x{meta['width']}"
    click.echo(
        f"wrote {config.out} ({config.format}): {meta['model']} taking raw {shape} samples, "
        f"{meta['num_classes']} classes {meta['class_names']}, checkpoint version "
        f"{meta['checkpoint']['version']}"
    )


def _print_scores(report: dict[str, Any], scored: str) -> None:
    click.echo(
        f"OA {report['oa']:.4f}  AA {report['aa']:.4f}  kappa {report['kappa']:.4f}  on {scored}"
    )
    per_class = report["per_class"]
    width = max(len(n) for n in per_class["names"])
    click.echo(f"  {'#':>3} {'class':<{width}}  accuracy  pixels")
    for k, name in enumerate(per_class["names"]):
        acc = per_class["accuracy"][k]
        cell = f"{acc:8.4f}" if acc is not None else f"{'-':>8}"
        click.echo(f"  {k + 1:3d} {name:<{width}}  {cell}  {per_class['support'][k]:6d}")


def _predict_cube(model: Any, options: dict[str, Any]) -> None:
    from common.data.convert.cube import load_labels, open_cube
    from common.data.convert.geotiff import write_class_geotiff
    from pserver.outputs.maps import write_png
    from pserver.outputs.palette import ground_truth_colours, resolve_palette
    from pserver.outputs.predict import (
        check_scene,
        count_nodata,
        predict_scene,
        score_map,
        scores_report,
    )
    from pserver.outputs.scene_views import composite, parse_bands

    out: Path = options["out"]
    if out.suffix.lower() != ".png":
        raise click.BadParameter(f"the map is a PNG file, got {str(out)!r}", param_hint="--out")
    names = model.class_names
    with open_cube(options["cube"]) as cube:
        check_scene(model, cube)
        gt = load_labels(options["gt"])[0] if options["gt"] else None
        if gt is not None and gt.shape != cube.shape[:2]:
            raise click.ClickException(
                f"ground truth {options['gt']!r} is {gt.shape[0]}x{gt.shape[1]} but cube "
                f"{options['cube']!r} is {cube.shape[0]}x{cube.shape[1]} (rows x cols)"
            )
        test_mask, gt = _test_pixels(model, options, cube.shape[:2], gt)
        rgb = None
        if options["rgb_bands"]:
            rgb = composite(cube, parse_bands(options["rgb_bands"], cube.shape[2]))
        proba = None
        if options["proba"]:
            proba = np.empty((*cube.shape[:2], len(names)), dtype=np.float32)
        classes = predict_scene(model, cube, options["batch"], options["progress"], proba)
        georef = cube.georef
    nodata = count_nodata(classes, names)
    if nodata:
        click.echo(
            f"warning: {nodata} of {classes.size} pixels have NaN or infinite values in their "
            f"patch and were not classified: no data in the map (index {len(names)} in the "
            ".npy, 0 in the GeoTIFF), left out of the scores",
            err=True,
        )
    from_gt = ground_truth_colours(options["gt"]) if options["gt"] else None
    palette, where = resolve_palette(options["palette"], names, from_gt)
    scored_gt = gt if gt is None or test_mask is None else np.where(test_mask, gt, 0)
    report = None
    if scored_gt is not None:
        report = scores_report(score_map(classes, scored_gt, len(names)), names)
    title = f"{Path(options['cube']).name}: {model.meta['model']}"
    if report is not None:
        title += f", OA {report['oa']:.3f} on " + _scored_wording(report["labelled"], test_mask)
    write_png(
        out,
        classes,
        names,
        gt,
        title,
        palette=palette,
        scored=test_mask,
        rgb=rgb,
        confidence=None if proba is None else proba.max(axis=2),
    )
    click.echo(
        f"wrote {out}: {classes.shape[0]}x{classes.shape[1]} map of {len(names)} classes "
        f"(colours: {where})"
    )
    if proba is not None:
        np.save(options["proba"], proba, allow_pickle=False)
        click.echo(
            f"wrote {options['proba']}: {'x'.join(map(str, proba.shape))} float32 class "
            "probabilities (softmax)"
        )
    if options["npy"]:
        np.save(options["npy"], classes, allow_pickle=False)
        click.echo(
            f"wrote {options['npy']}: class indices 0..{len(names) - 1}, {len(names)} = no data"
        )
    if options["geotiff"]:
        if georef is None:
            click.echo(
                "note: the cube has no georeferencing; the GeoTIFF has none either", err=True
            )
        write_class_geotiff(options["geotiff"], classes, georef, names, palette)
        click.echo(f"wrote {options['geotiff']}: classes 1..{len(names)}, 0 = no data")
    if report is not None:
        _print_scores(report, _scored_wording(report["labelled"], test_mask))
        if options["metrics"]:
            report["scored"] = "test" if test_mask is not None else "labelled"
            options["metrics"].write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _scored_wording(count: int, test_mask: np.ndarray | None) -> str:
    """Which pixels a map's scores count, in words for its title and the terminal."""
    if test_mask is None:
        return f"all {count} labelled pixels (training pixels included)"
    return f"{count} test pixels (training and guard-band pixels not scored)"


def _test_pixels(
    model: Any, options: dict[str, Any], shape: tuple[int, int], gt: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """With --test-only: the test pixels of the model's dataset (or --dataset), and the ground
    truth (the dataset's labels when --gt is not given)."""
    from pserver.outputs.scene_views import dataset_pixels

    if not options["test_only"]:
        return None, gt
    trained_on = model.meta.get("dataset") or {}
    path = options["dataset"] or trained_on.get("path")
    if not path or not Path(path).is_file():
        raise click.UsageError(
            f"--test-only needs the dataset the model was trained on; {path!r} is not found "
            "from here: pass --dataset DATA.h5"
        )
    mask, labels = dataset_pixels(path, shape, trained_on.get("fingerprint"))
    return mask, gt if gt is not None else labels


@click.command("predict")
@click.option(
    "--model",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Model file written by 'pserver export'.",
)
@click.option(
    "--cube",
    help="Scene to classify pixel by pixel: FILE.mat[:KEY] (loaded whole), ENVI .hdr or "
    "GeoTIFF (read a band of rows at a time).",
)
@click.option(
    "--images",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder of images to classify one by one (scene models); --out is then a CSV file.",
)
@file_option(
    "--out", "MAP.png (with --cube) or predictions.csv (with --images).", out=True, required=True
)
@file_option("--npy", "Also save the class indices (0..K-1) as a .npy array.", out=True)
@file_option(
    "--geotiff",
    "Also save the map as a GeoTIFF with the cube's CRS and transform (classes 1..K).",
    out=True,
)
@click.option(
    "--gt",
    help="Ground truth FILE[:KEY] (0 = unlabelled): prints OA/AA/kappa and per-class accuracy "
    "on labelled pixels and draws it beside the map.",
)
@file_option("--metrics", "With --gt or --test-only: also write the scores as JSON here.", out=True)
@click.option(
    "--palette",
    default="auto",
    help="Class colours: auto (the --gt file's own colours if it has them, else colourblind), "
    "colourblind (Okabe-Ito; by class name water blue, vegetation green, soil or rock orange, "
    "built-up vermillion), tab20, #rrggbb,... in class order, "
    "or name=#rrggbb,... for some classes.",
)
@click.option(
    "--test-only",
    is_flag=True,
    help="Score only the test pixels of the model's dataset (or --dataset); the ground truth "
    "is the dataset's labels unless --gt is given.",
)
@file_option(
    "--dataset",
    "With --test-only: the prepared dataset whose test pixels are scored (default: the "
    "one the model was trained on, as recorded in the model file).",
)
@click.option(
    "--rgb-bands",
    help="R,G,B: 0-based band indices of the cube drawn as a composite panel (2-98 percentile "
    "stretch), e.g. 29,19,9 for a true-colour view of a 198-band AVIRIS cube.",
)
@file_option(
    "--proba",
    "Also save per-class probabilities (rows x cols x K float32 softmax) as .npy, and draw "
    "the largest as a confidence panel.",
    out=True,
)
@click.option(
    "--batch",
    default=1024,
    type=click.IntRange(min=1),
    help=f"Patches per forward pass (images: at most {IMAGE_BATCH}).",
)
@click.option("--device", default="cpu", help="cpu, cuda or cuda:N.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar on stderr.")
@allow_model_option("the model file")
def predict_cmd(
    model: Path,
    cube: str | None,
    images: Path | None,
    allow_model: tuple[str, ...],
    **options: Any,
) -> None:
    """Classify every pixel of a scene (--cube) or every image of a folder (--images)."""
    from common.training.device import resolve_device
    from pserver.outputs.images import predict_images
    from pserver.outputs.model_file import load_model

    if (cube is None) == (images is None):
        raise click.UsageError("give exactly one of --cube FILE or --images DIR")
    if options["metrics"] and not (options["gt"] or options["test_only"]):
        raise click.UsageError("--metrics needs --gt or --test-only")
    cube_only = ("npy", "geotiff", "gt", "test_only", "rgb_bands", "proba", "dataset")
    if images is not None and any(options[k] for k in cube_only):
        raise click.UsageError(
            "--npy, --geotiff, --gt, --test-only, --dataset, --rgb-bands and --proba apply to "
            "--cube only"
        )
    try:
        device = resolve_device(options["device"])
        net = load_model(model, device, allow_model)
        if cube is not None:
            _predict_cube(net, {**options, "cube": cube})
            return
        assert images is not None  # one of --cube and --images is required
        result = predict_images(
            net, images, options["out"], min(options["batch"], IMAGE_BATCH), options["progress"]
        )
    except (PSError, OSError) as exc:
        raise _fail(exc) from exc
    accuracy = result["accuracy"]
    click.echo(
        f"wrote {options['out']}: {result['images']} images"
        + (f", accuracy {accuracy:.4f} against their folder names" if accuracy is not None else "")
    )


@click.command("evaluate-snapshots")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--target-oa",
    type=float,
    help="Report the first version reaching this test OA (default: the run's --target-oa).",
)
@file_option(
    "--dataset", "The run's dataset file (default: the one RUN_DIR/snapshots/run.json names)."
)
@click.option("--batch", type=int, default=512, help="Evaluation batch size.")
@click.option("--threads", type=int, default=1, help="Torch CPU threads.")
@click.option("--progress/--no-progress", default=True, help="Progress bar.")
@allow_model_option("RUN_DIR/snapshots/run.json")
def evaluate_snapshots_cmd(**options: Any) -> None:
    """Score every snapshot in RUN_DIR/snapshots on the whole test split after training.

    Writes RUN_DIR/snapshots.jsonl (version, epoch, train_time_s, samples, final, oa, aa,
    kappa, loss) and prints the first version reaching the target and its training time.
    """
    from pserver.snapshots.snapshot_eval import SnapshotEvalConfig, describe, evaluate_snapshots

    try:
        result = evaluate_snapshots(SnapshotEvalConfig(**options))
    except PSError as exc:
        raise _fail(exc) from exc
    click.echo(describe(result))


COMMANDS = (export_cmd, predict_cmd, evaluate_snapshots_cmd)
