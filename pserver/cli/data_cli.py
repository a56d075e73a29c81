"""The ``pserver data`` commands: prepare, synthesise and inspect HDF5 datasets."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.cli_help import FullHelpGroup, OutFile
from common.data.dataset import DatasetMeta, describe
from common.errors import DatasetError

OUT = click.option("--out", required=True, type=OutFile(), help="The HDF5 file to write.")
SEED = click.option("--seed", default=0, type=int, help="Seed of the split.")
PROGRESS = click.option("--progress/--no-progress", default=True, help="Show progress bars.")


SYNTH_SIZES = (  # option, lowest value, help (not given: the default of synth_hsi/synth_scenes)
    (
        "samples",
        1,
        "hsi: cap on labelled pixels used (default: all, about size*size); "
        "scenes: number of images (default 2000).",
    ),
    ("bands", 1, "Spectral bands (default: hsi 64, scenes 13)."),
    ("size", 1, "hsi: scene side in pixels; scenes: image side (default 64 for both)."),
    ("classes", 2, "Number of classes (default: hsi 6, scenes 10)."),
)


def _synth_sizes(command: Callable[..., Any]) -> Callable[..., Any]:
    """``synth``'s size options, in ``SYNTH_SIZES`` order."""
    for name, low, text in reversed(SYNTH_SIZES):
        option = click.option(f"--{name}", type=click.IntRange(min=low), help=text)
        command = option(command)
    return command


def _train_fraction(default: float | None, help: str) -> Any:
    """``--train-fraction``: a fraction in (0, 1)."""
    return click.option(
        "--train-fraction",
        default=default,
        type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
        help=help,
    )


def _run(fn: Callable[..., DatasetMeta], **kwargs: Any) -> DatasetMeta:
    """Call a dataset function, turning DatasetError into a click error."""
    try:
        return fn(**kwargs)
    except DatasetError as exc:
        raise click.ClickException(str(exc)) from exc


def _summary(meta: DatasetMeta) -> str:
    shape = "x".join(map(str, meta.shape))
    return (
        f"wrote {meta.path}: {meta.num_samples} samples of {shape}, {meta.num_classes} classes, "
        f"train {meta.train_count} / test {meta.test_count}, fingerprint {meta.fingerprint[:12]}"
    )


def _echo_split(meta: DatasetMeta, requested: float, patch: int | None, split: str) -> None:
    """Print the realised per-class split beside the request, then one line per warning."""
    from common.data.split_report import class_splits, split_table, split_warnings

    rows = class_splits(meta)
    for line in split_table(rows, requested, split):
        click.echo(line)
    for line in split_warnings(rows, requested, patch, split):
        click.secho(f"warning: {line}", fg="yellow", err=True)


def _names(text: str | None) -> list[str] | None:
    """Split a comma-separated --classes value; None when not given."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise click.BadParameter(f"empty class name in {text!r}", param_hint="--classes")
    return names


@click.group("data", cls=FullHelpGroup, context_settings={"show_default": True})
def data_group() -> None:
    """Prepare, synthesise and inspect HDF5 datasets."""


@data_group.group("prepare", cls=FullHelpGroup)
def prepare_group() -> None:
    """Build a dataset file from source data."""


@prepare_group.command("hsi")
@click.option(
    "--cube",
    required=True,
    help="Hyperspectral cube (rows, cols, bands): FILE.mat[:KEY] (loaded whole), an ENVI "
    "FILE.hdr (or its data file) or a GeoTIFF FILE.tif (both read a band of rows at a time).",
)
@click.option(
    "--gt",
    required=True,
    help="Class map (rows, cols): FILE.mat[:KEY], a single-band GeoTIFF or an ENVI "
    "classification file; 0 = unlabelled, 1..K = classes.",
)
@OUT
@click.option("--patch", default=5, type=int, help="Odd patch side P.")
@_train_fraction(0.1, "Fraction of each class's labelled pixels used for training.")
@click.option(
    "--split",
    default="random",
    type=click.Choice(["random", "disjoint"]),
    help="random: stratified per pixel (test patches overlap training patches); "
    "disjoint: spatial tiles, no test patch shares a pixel with a training patch.",
)
@SEED
@click.option(
    "--classes",
    help="Comma-separated names of classes 1..K (default: from the .mat 'class_names' "
    "variable or the ENVI header, else class_1..class_K).",
)
@click.option(
    "--x-dtype",
    default="float32",
    type=click.Choice(["float32", "float16", "raw"]),
    help="How samples are stored and served: normalised float32 or float16, or raw: the "
    "cube's integers (uint8/uint16/int16), normalised by the reader and the workers.",
)
@click.option(
    "--shape",
    help="ROWS,COLS of a .mat cube stored as a bands x pixels matrix (pixels in column-major "
    "order); default: the file's nRow/nCol.",
)
@click.option(
    "--bands-first",
    is_flag=True,
    help="The .mat cube is (bands, rows, cols), or its matrix is bands x pixels.",
)
@click.option(
    "--gt-abundance",
    is_flag=True,
    help="--gt holds abundance maps (end-members x pixels, key A by default, as Jasper Ridge, "
    "Samson and Urban ship them): each pixel gets its most abundant end-member.",
)
@click.option(
    "--min-abundance",
    default=0.5,
    type=click.FloatRange(0.0, 1.0),
    help="With --gt-abundance: pixels whose largest abundance is below this are unlabelled.",
)
@PROGRESS
def prepare_hsi_cmd(
    cube: str, gt: str, classes: str | None, shape: str | None, **options: Any
) -> None:
    """Cut P x P patches around every labelled pixel of a cube and class map.

    The cube may also be a bands x pixels matrix with nRow/nCol, as unmixing scenes ship.
    """
    from common.data.convert.hsi import prepare_hsi
    from common.data.convert.layout import parse_shape

    try:
        scene_shape = parse_shape(shape) if shape is not None else None
    except DatasetError as exc:
        raise click.BadParameter(str(exc), param_hint="--shape") from exc

    meta = _run(
        prepare_hsi,
        cube_spec=cube,
        gt_spec=gt,
        class_names=_names(classes),
        shape=scene_shape,
        **options,
    )
    click.echo(f"cube layout: {meta.attrs.get('layout')}")
    click.echo(f"ground truth: {meta.attrs.get('gt_layout')}")
    click.echo(_summary(meta))
    _echo_split(meta, options["train_fraction"], options["patch"], options["split"])


@prepare_group.command("folder")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@OUT
@_train_fraction(0.8, "Fraction of each class's images used for training.")
@SEED
@click.option(
    "--size",
    type=click.IntRange(min=1),
    help="Resize every image to SIZE x SIZE (default: keep; all images must share one size).",
)
@PROGRESS
def prepare_folder_cmd(**options: Any) -> None:
    """Build a scenes dataset from DIR/<class>/*.tif|tiff|png|jpg|jpeg (EuroSAT layout).

    Class names are the sorted folder names; TIFFs may have any number of bands.
    """
    from common.data.convert.folder import prepare_folder

    meta = _run(prepare_folder, **options)
    click.echo(_summary(meta))
    _echo_split(meta, options["train_fraction"], None, "random")


@prepare_group.command("torch")
@click.option(
    "--dataset",
    required=True,
    help="package.module:Factory returning a map-style torch Dataset whose samples are "
    "{'image', 'label'} dicts (torchgeo) or (x, y) tuples; the module must be importable "
    "(PYTHONPATH).",
)
@click.option(
    "--kwargs",
    help="Factory arguments as k=v,k2=v2 (values: Python literals, else strings).",
)
@OUT
@click.option(
    "--classes",
    help="Comma-separated class names for labels 0..K-1 (default: the dataset's 'classes' "
    "attribute, else class_0..class_K-1).",
)
@_train_fraction(0.8, "Fraction of each class's samples used for training (stratified).")
@SEED
@PROGRESS
def prepare_torch_cmd(
    dataset: str, kwargs: str | None, classes: str | None, **options: Any
) -> None:
    """Stream a torch Dataset (e.g. a torchgeo classification dataset) into a scenes file."""
    from common.data.convert.torch_dataset import parse_kwargs, prepare_torch

    try:
        factory_kwargs = parse_kwargs(kwargs)
    except DatasetError as exc:
        raise click.BadParameter(str(exc), param_hint="--kwargs") from exc
    meta = _run(
        prepare_torch,
        spec=dataset,
        kwargs=factory_kwargs,
        class_names=_names(classes),
        **options,
    )
    click.echo(_summary(meta))


@data_group.command("synth")
@click.option(
    "--kind",
    required=True,
    type=click.Choice(["hsi", "scenes"]),
    help="hsi: patches of a synthetic hyperspectral scene; scenes: EuroSAT-shaped images.",
)
@OUT
@_synth_sizes
@click.option("--patch", default=5, type=int, help="hsi only: odd patch side P.")
@_train_fraction(None, "Training fraction per class (default: hsi 0.1, scenes 0.8).")
@click.option("--seed", default=0, type=int, help="Random seed.")
def synth_cmd(kind: str, out: Path, patch: int, seed: int, **given: float | None) -> None:
    """Write a synthetic dataset that a small CNN needs a few epochs to learn."""
    from common.data.convert.synth import synth_hsi, synth_scenes

    # given: --samples, --bands, --size, --classes, --train-fraction (None: the kind's default)
    args = {k: v for k, v in given.items() if v is not None}
    if kind == "hsi":
        meta = _run(synth_hsi, out=out, patch=patch, seed=seed, **args)
    else:
        meta = _run(synth_scenes, out=out, seed=seed, **args)
    click.echo(_summary(meta))


@data_group.command("info")
@click.argument("dataset", type=click.Path(dir_okay=False))
@click.option("--json", is_flag=True, help="Print JSON.")
def info_cmd(dataset: str, **flags: bool) -> None:
    """Show a dataset's samples, classes, per-split counts and shape."""
    try:
        info = describe(dataset)
    except DatasetError as exc:
        raise click.ClickException(str(exc)) from exc
    if flags["json"]:
        click.echo(json.dumps(info, indent=2))
        return
    counts = info["counts"]
    click.echo(f"path:        {info['path']}")
    click.echo(f"kind:        {info['kind']}")
    click.echo(f"samples:     {info['samples']} (train {counts['train']}, test {counts['test']})")
    click.echo(f"shape:       {' x '.join(map(str, info['shape']))} (C x H x W)")
    raw = " (raw, normalised on read)" if info["normalise_on_read"] else ""
    click.echo(f"stored as:   {info['stored_dtype']}{raw}")
    click.echo(f"classes:     {info['classes']}")
    width = max(len(n) for n in info["class_names"])
    for i, name in enumerate(info["class_names"]):
        tr, te = counts["per_class"]["train"][i], counts["per_class"]["test"][i]
        click.echo(f"  {i:3d} {name:<{width}}  train {tr:7d}  test {te:7d}")
    click.echo(f"fingerprint: {info['fingerprint']}")
    if info["source"]:
        click.echo(f"source:      {info['source']}")
