"""Image-folder preparation: EuroSAT-style DIR/<class>/*.tif|png|jpg into a scenes dataset."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.dataset import DatasetMeta
from common.data.splits import stratified_split
from common.data.writer import write_scenes
from common.errors import DatasetError

log = logging.getLogger(__name__)

TIFF_SUFFIXES = (".tif", ".tiff")
PIL_SUFFIXES = (".png", ".jpg", ".jpeg")
SUFFIXES = TIFF_SUFFIXES + PIL_SUFFIXES
_PATTERN = "*.tif|tiff|png|jpg|jpeg"


@dataclass(frozen=True)
class FolderScan:
    """The images found under a class-per-folder directory.

    Attributes:
        root: the scanned directory.
        class_names: sorted names of the class folders.
        files: every image, class by class, sorted by name within a class.
        labels: class index of each file (int64, same order as ``files``).
        skipped: files in class folders that were ignored (other suffixes, sub-folders).
    """

    root: Path
    class_names: tuple[str, ...]
    files: tuple[Path, ...]
    labels: np.ndarray
    skipped: int


def scan_folder(directory: str | os.PathLike[str]) -> FolderScan:
    """List the class folders of ``directory`` and the images in each.

    Class folders are the non-hidden sub-directories, sorted by name; images are the files
    directly inside them whose suffix (any case) is .tif, .tiff, .png, .jpg or .jpeg. Hidden
    entries (names starting with ".") are ignored; other files are skipped and counted.

    Args:
        directory: the root folder, laid out as ``DIR/<class>/<image>``.

    Returns:
        The scan.

    Raises:
        DatasetError: ``directory`` is not a folder, has no class folders, or a class folder
            holds no image.
    """
    root = Path(directory)
    if not root.is_dir():
        raise DatasetError(f"{str(root)!r} is not a folder")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetError(
            f"{str(root)!r} has no class folders: expected {root}/<class>/{_PATTERN}"
        )
    files: list[Path] = []
    labels: list[int] = []
    skipped = 0
    for label, folder in enumerate(classes):
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        images = [p for p in entries if p.is_file() and p.suffix.lower() in SUFFIXES]
        skipped += len(entries) - len(images)
        if not images:
            raise DatasetError(
                f"class folder {str(folder)!r} holds no images ({_PATTERN}); "
                "remove it or add images"
            )
        files.extend(images)
        labels.extend([label] * len(images))
    if skipped:
        log.warning("skipped %d entries in class folders that are not %s images", skipped, _PATTERN)
    return FolderScan(
        root=root,
        class_names=tuple(p.name for p in classes),
        files=tuple(files),
        labels=np.asarray(labels, dtype=np.int64),
        skipped=skipped,
    )


def _channels_first(arr: np.ndarray, axes: str) -> np.ndarray:
    """Move the Y and X axes of a tifffile series last and merge all others into bands."""
    if "Y" in axes and "X" in axes:
        arr = np.moveaxis(arr, [axes.index("Y"), axes.index("X")], [-2, -1])
    return arr.reshape(-1, *arr.shape[-2:])


def _decode(path: Path) -> np.ndarray:
    """Decode one image file into an array of shape (C, H, W), any numeric dtype."""
    if path.suffix.lower() in TIFF_SUFFIXES:
        import tifffile

        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            arr = series.asarray()
            return _channels_first(arr, series.axes) if arr.ndim >= 2 else arr
    from PIL import Image

    with Image.open(path) as opened:
        img: Image.Image = opened
        if img.mode == "P":
            img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        elif img.mode == "1":
            img = img.convert("L")
        arr = np.asarray(img)
    return arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)


def _resize(image: np.ndarray, size: int) -> np.ndarray:
    """Resize every band of a (C, H, W) float32 image to size x size (bilinear, antialiased)."""
    from PIL import Image

    out = np.empty((image.shape[0], size, size), dtype=np.float32)
    for c, band in enumerate(image):
        resized = Image.fromarray(np.ascontiguousarray(band)).resize(
            (size, size), Image.Resampling.BILINEAR
        )
        out[c] = np.asarray(resized)
    return out


def read_image(path: str | os.PathLike[str], size: int | None = None) -> np.ndarray:
    """Read one image as float32 (C, H, W): TIFF with tifffile, PNG and JPEG with Pillow.

    Any band count is accepted. A TIFF's axes other than rows (Y) and columns (X) (samples,
    pages, planes) become bands; a PNG/JPEG's colour channels become bands (palette images are
    expanded to RGB/RGBA, 1-bit images to 0/255 grey). Values keep their original scale.

    Args:
        path: the image file.
        size: resize to size x size when given (bilinear, antialiased when shrinking).

    Returns:
        A float32 array (C, H, W) of finite values.

    Raises:
        DatasetError: the file cannot be read or decoded, is not a numeric 2-D image, or holds
            NaN or Inf; the message names the file.
    """
    path = Path(path)
    try:
        arr = _decode(path)
    except Exception as exc:  # decoders raise many types (OSError, ValueError, SyntaxError…)
        raise DatasetError(f"cannot read image {str(path)!r}: {exc}") from exc
    if arr.dtype.kind not in "biuf" or arr.ndim != 3 or min(arr.shape, default=0) < 1:
        raise DatasetError(
            f"image {str(path)!r} is not a numeric 2-D image (dtype {arr.dtype}, shape {arr.shape})"
        )
    image = arr.astype(np.float32)
    if not np.all(np.isfinite(image)):
        raise DatasetError(f"image {str(path)!r} contains NaN or Inf (or values beyond float32)")
    if size is not None and image.shape[1:] != (size, size):
        image = _resize(image, size)
    return image


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) + " (bands x rows x cols)"


class _Images:
    """Reads scanned file ``i`` and its label, and checks that all share one shape."""

    def __init__(self, scan: FolderScan, size: int | None) -> None:
        self.scan = scan
        self.size = size
        self.shape: tuple[int, int, int] | None = None
        self._first: Path | None = None

    def __call__(self, i: int) -> tuple[np.ndarray, int]:
        path = self.scan.files[i]
        image = read_image(path, self.size)
        if self.shape is None:
            self.shape, self._first = image.shape, path
        elif image.shape != self.shape:
            hint = "" if self.size is not None else " (or give --size S to resize them)"
            raise DatasetError(
                f"image {str(path)!r} is {_shape_text(image.shape)} but {str(self._first)!r} is "
                f"{_shape_text(self.shape)}: all images must share one band count and size{hint}"
            )
        return image, int(self.scan.labels[i])


def prepare_folder(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    train_fraction: float = 0.8,
    seed: int = 0,
    size: int | None = None,
    progress: bool = False,
) -> DatasetMeta:
    """Convert a class-per-folder image collection (EuroSAT layout) into a scenes dataset.

    Two streaming passes over the files (``write_scenes``): the first checks every image
    (readable, one shape) and takes its per-band statistics; the second normalises the images
    with the training images' mean and standard deviation and writes them in blocks. At most
    one block of images is in memory at a time. Samples are stored class by class, files
    sorted by name; ``/files`` holds each sample's path relative to ``directory``.

    Args:
        directory: ``DIR`` with one sub-folder per class (sorted names become classes 0..K-1).
        out: the dataset file to write.
        train_fraction: training fraction per class (stratified split), in (0, 1).
        seed: seed of the split.
        size: resize every image to size x size when given; otherwise all images must
            already share one size.
        progress: show a progress bar per pass (images read) on stderr.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: no class folders, an empty class folder, an unreadable image, images of
            different sizes or band counts, or an argument out of range; file errors name the
            file.
    """
    if not 0.0 < train_fraction < 1.0:
        raise DatasetError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    if size is not None and (not isinstance(size, (int, np.integer)) or size < 1):
        raise DatasetError(f"size must be a positive integer, got {size!r}")
    scan = scan_folder(directory)
    k = len(scan.class_names)
    log.info(
        "%s: %d images in %d classes; pass 1 (check, statistics)", scan.root, len(scan.files), k
    )
    attrs = {"train_fraction": float(train_fraction), "seed": int(seed)}
    if size is not None:
        attrs["size"] = int(size)
    rel = [str(p.relative_to(scan.root)).encode() for p in scan.files]
    return write_scenes(
        out,
        _Images(scan, size),
        len(scan.files),
        lambda labels: (scan.class_names, *stratified_split(labels, train_fraction, seed, k)),
        source=f"prepare folder {scan.root}" + (f" --size {size}" if size else ""),
        progress=progress,
        extra_attrs=attrs,
        extra_datasets={"files": np.asarray(rel, dtype=bytes)},
    )
