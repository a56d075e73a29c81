"""``pserver export`` and ``pserver predict``: get a trained model out and classify scenes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click

from common.errors import PSError

log = logging.getLogger(__name__)

IMAGE_BATCH = 64  # whole images are much larger than pixel patches


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The model file to write (e.g. MODEL.pt).",
)
@click.option(
    "--checkpoint",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Checkpoint to export (default: the newest in RUN_DIR/checkpoints).",
)
@click.option(
    "--dataset",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The run's dataset file (default: the one named in RUN_DIR/summary.json).",
)
@click.option(
    "--format",
    type=click.Choice(["program", "state-dict"]),
    default="program",
    help="program: torch.export program with the normalisation built in, loads with "
    "torch.export.load alone; state-dict: weights for torch.load(weights_only=True).",
)
def export_cmd(
    run_dir: Path, out: Path, checkpoint: Path | None, dataset: Path | None, format: str
) -> None:
    """Export a run's model: raw (unnormalised) C x P x P samples in, class logits out."""
    from pserver.outputs.export import ExportConfig, export

    config = ExportConfig(
        run_dir=run_dir, out=out, checkpoint=checkpoint, dataset=dataset, format=format
    )
    try:
        meta = export(config)
    except PSError as exc:
        raise _fail(exc) from exc
    shape = f"{meta['bands']}x{meta['height']}x{meta['width']}"
    click.echo(
        f"wrote {out} ({format}): {meta['model']} taking raw {shape} samples, "
        f"{meta['num_classes']} classes {meta['class_names']}, checkpoint version "
        f"{meta['checkpoint']['version']}"
    )


def _print_scores(report: dict[str, Any]) -> None:
    click.echo(
        f"OA {report['oa']:.4f}  AA {report['aa']:.4f}  kappa {report['kappa']:.4f}  "
        f"on {report['labelled']} labelled pixels"
    )
    per_class = report["per_class"]
    width = max(len(n) for n in per_class["names"])
    click.echo(f"  {'#':>3} {'class':<{width}}  accuracy  pixels")
    for k, name in enumerate(per_class["names"]):
        acc = per_class["accuracy"][k]
        cell = f"{acc:8.4f}" if acc is not None else f"{'-':>8}"
        click.echo(f"  {k:3d} {name:<{width}}  {cell}  {per_class['support'][k]:6d}")


def _predict_cube(model: Any, options: dict[str, Any]) -> None:
    from common.data.convert.cube import load_labels, open_cube
    from pserver.outputs.maps import write_geotiff, write_npy, write_png
    from pserver.outputs.predict import check_scene, predict_scene, score_map, scores_report

    out: Path = options["out"]
    if out.suffix.lower() != ".png":
        raise click.BadParameter(f"the map is a PNG file, got {str(out)!r}", param_hint="--out")
    with open_cube(options["cube"]) as cube:
        check_scene(model, cube)
        gt = load_labels(options["gt"])[0] if options["gt"] else None
        if gt is not None and gt.shape != cube.shape[:2]:
            raise click.ClickException(
                f"ground truth {options['gt']!r} is {gt.shape[0]}x{gt.shape[1]} but cube "
                f"{options['cube']!r} is {cube.shape[0]}x{cube.shape[1]} (rows x cols)"
            )
        classes = predict_scene(model, cube, options["batch"], options["progress"])
        georef = cube.georef
    names = model.class_names
    report = scores_report(score_map(classes, gt, len(names)), names) if gt is not None else None
    title = f"{Path(options['cube']).name}: {model.meta['model']}"
    if report is not None:
        title += f", OA {report['oa']:.3f} on {report['labelled']} labelled pixels"
    write_png(out, classes, names, gt, title)
    click.echo(f"wrote {out}: {classes.shape[0]}x{classes.shape[1]} map of {len(names)} classes")
    if options["npy"]:
        write_npy(options["npy"], classes)
        click.echo(f"wrote {options['npy']}: class indices 0..{len(names) - 1}")
    if options["geotiff"]:
        if georef is None:
            click.echo(
                "note: the cube has no georeferencing; the GeoTIFF has none either", err=True
            )
        write_geotiff(options["geotiff"], classes, georef, names)
        click.echo(f"wrote {options['geotiff']}: classes 1..{len(names)}, 0 = no data")
    if report is not None:
        _print_scores(report)
        if options["metrics"]:
            options["metrics"].write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


@click.command("predict")
@click.option(
    "--model",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Model file written by 'pserver export'.",
)
@click.option(
    "--cube",
    default=None,
    help="Scene to classify pixel by pixel: FILE.mat[:KEY] (loaded whole), ENVI .hdr or "
    "GeoTIFF (read a band of rows at a time).",
)
@click.option(
    "--images",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder of images to classify one by one (scene models); --out is then a CSV file.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="MAP.png (with --cube) or predictions.csv (with --images).",
)
@click.option(
    "--npy",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also save the class indices (0..K-1) as a .npy array.",
)
@click.option(
    "--geotiff",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also save the map as a GeoTIFF with the cube's CRS and transform (classes 1..K).",
)
@click.option(
    "--gt",
    default=None,
    help="Ground truth FILE[:KEY] (0 = unlabelled): prints OA/AA/kappa and per-class accuracy "
    "on labelled pixels and draws it beside the map.",
)
@click.option(
    "--metrics",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --gt: also write the scores as JSON here.",
)
@click.option(
    "--batch",
    default=1024,
    type=click.IntRange(min=1),
    help=f"Patches per forward pass (images: at most {IMAGE_BATCH}).",
)
@click.option("--device", default="cpu", help="cpu, cuda or cuda:N.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar on stderr.")
def predict_cmd(model: Path, cube: str | None, images: Path | None, **options: Any) -> None:
    """Classify every pixel of a scene (--cube) or every image of a folder (--images)."""
    from common.training.device import resolve_device
    from pserver.outputs.images import predict_images
    from pserver.outputs.model_file import load_model

    if (cube is None) == (images is None):
        raise click.UsageError("give exactly one of --cube FILE or --images DIR")
    if options["metrics"] and not options["gt"]:
        raise click.UsageError("--metrics needs --gt")
    if images is not None and any(options[k] for k in ("npy", "geotiff", "gt")):
        raise click.UsageError("--npy, --geotiff and --gt apply to --cube only")
    try:
        device = resolve_device(options["device"])
        net = load_model(model, device)
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


COMMANDS = (export_cmd, predict_cmd)
