"""Scene layouts as distributed: bands x pixels matrices with nRow/nCol, and abundance maps.

Unmixing benchmarks (Jasper Ridge, Samson, Urban) ship a scene as a matrix ``V`` or ``Y`` of
bands x pixels with the scalars ``nRow`` and ``nCol`` beside it, and their ground truth as
abundances ``A`` (end-members x pixels). The pixels run in MATLAB's column-major order: pixel
``p`` (0-based) lies at row ``p % nRow``, column ``p // nRow``, as MATLAB's
``reshape(V(b, :), nRow, nCol)`` reads them. This module turns both into the (rows, cols, bands)
cube and the (rows, cols) class map the rest of the pipeline reads, and says what it detected.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data.convert.matfile import load_mat_array, mat_variables, split_spec
from common.errors import DatasetError

ROWS_KEYS = ("nRow", "nrow", "nRows", "rows")
COLS_KEYS = ("nCol", "ncol", "nCols", "cols")
NAME_KEYS = ("class_names", "cood")
ABUNDANCE_KEY = "A"
DEFAULT_MIN_ABUNDANCE = 0.5


def parse_shape(text: str) -> tuple[int, int]:
    """Parse ``ROWS,COLS``.

    Args:
        text: two positive integers separated by a comma.

    Returns:
        ``(rows, cols)``.

    Raises:
        DatasetError: the text is not two positive integers.
    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise DatasetError(f"shape must be ROWS,COLS (two positive integers), got {text!r}")
    return int(parts[0]), int(parts[1])


def _scalar(path: Path, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that the .mat file holds as a positive integer scalar."""
    held = {n: s for n, s, _ in mat_variables(path)}
    for name in names:
        if name in held and int(np.prod(held[name])) == 1:
            value = float(np.ravel(load_mat_array(f"{path}:{name}"))[0])
            if value > 0 and value == int(value):
                return int(value)
    return None


def _file_shape(path: Path) -> tuple[int, int] | None:
    """``(nRow, nCol)`` when the .mat file stores both, else None."""
    if path.suffix.lower() != ".mat" or not path.is_file():
        return None
    rows, cols = _scalar(path, ROWS_KEYS), _scalar(path, COLS_KEYS)
    return (rows, cols) if rows is not None and cols is not None else None


def _data_key(path: Path, key: str | None, prefer: tuple[str, ...] = ()) -> str | None:
    """The variable to read when a .mat file holds a matrix beside its nRow/nCol scalars.

    With ``key`` given it is used. Otherwise the first of ``prefer`` that the file holds, else
    the largest array with at least two dimensions when every other variable is a scalar or
    smaller (the distributed files also hold ``maxValue``, ``SlectBands`` and the like).
    """
    if key is not None or path.suffix.lower() != ".mat":
        return key
    variables = [(n, s) for n, s, _ in mat_variables(path) if not n.startswith("__")]
    for name in prefer:
        if any(n == name for n, _ in variables):
            return name
    arrays = sorted(
        ((int(np.prod(s)), n) for n, s in variables if len(s) >= 2 and min(s) > 1),
        reverse=True,
    )
    return arrays[0][1] if arrays else None


def _spec(path: Path, key: str | None) -> str:
    return f"{path}:{key}" if key is not None else str(path)


def pixels_to_grid(
    matrix: np.ndarray, shape: tuple[int, int], bands_first: bool | None, what: str
) -> tuple[np.ndarray, str]:
    """Turn a 2-D bands x pixels (or pixels x bands) matrix into (rows, cols, bands).

    Args:
        matrix: the 2-D array.
        shape: (rows, cols) of the scene; rows x cols must equal the pixel axis.
        bands_first: True for bands x pixels, False for pixels x bands, None to tell from
            which axis has rows x cols entries.
        what: the array's name in messages.

    Returns:
        ``(cube, orientation)``: the (rows, cols, bands) array and ``"bands x pixels"`` or
        ``"pixels x bands"``.

    Raises:
        DatasetError: no axis has rows x cols entries.
    """
    rows, cols = shape
    pixels = rows * cols
    if bands_first is None:
        if matrix.shape[1] == pixels:
            bands_first = True
        elif matrix.shape[0] == pixels:
            bands_first = False
    if bands_first is None or matrix.shape[1 if bands_first else 0] != pixels:
        raise DatasetError(
            f"{what} is {matrix.shape[0]} x {matrix.shape[1]} but the scene has {rows} x {cols} "
            f"= {pixels} pixels; give the scene's --shape ROWS,COLS"
        )
    per_pixel = matrix if bands_first else matrix.T  # (bands, pixels)
    # Column-major pixel order: (bands, cols, rows) in C order, then rows first.
    cube = per_pixel.reshape(per_pixel.shape[0], cols, rows).transpose(2, 1, 0)
    return np.ascontiguousarray(cube), "bands x pixels" if bands_first else "pixels x bands"


def load_scene(
    spec: str, shape: tuple[int, int] | None = None, bands_first: bool = False
) -> tuple[np.ndarray, str | None]:
    """Load a .mat scene in any of the layouts it is distributed in, as (rows, cols, bands).

    Layouts: a (rows, cols, bands) cube; a (bands, rows, cols) cube with ``bands_first``; a
    bands x pixels (or pixels x bands) matrix whose scene shape comes from ``shape`` or from
    ``nRow``/``nCol`` variables in the same file (pixels in column-major order). Without a KEY
    a file holding nRow/nCol is read from its largest matrix.

    Args:
        spec: ``FILE.mat[:KEY]``.
        shape: (rows, cols) for a 2-D matrix; overrides nRow/nCol in the file.
        bands_first: a 3-D array is (bands, rows, cols); a 2-D one is bands x pixels.

    Returns:
        ``(cube, layout)``: the layout says how the array was read, None for a plain
        (rows, cols, bands) cube.

    Raises:
        DatasetError: the file cannot be read or its shape does not fit any layout.
    """
    path, key = split_spec(spec)
    file_shape = _file_shape(path)
    if file_shape is not None:
        key = _data_key(path, key, prefer=("V", "Y"))
    array = load_mat_array(_spec(path, key))
    name = _spec(path, key)
    if array.ndim == 3:
        if bands_first:
            b, r, c = array.shape
            layout = f"bands x rows x cols ({b} x {r} x {c}) -> {r} x {c} x {b}"
            return np.ascontiguousarray(array.transpose(1, 2, 0)), layout
        return array, None
    if array.ndim != 2:
        raise DatasetError(
            f"cube {spec!r} must be (rows, cols, bands), (bands, rows, cols) with --bands-first, "
            f"or a bands x pixels matrix with nRow/nCol or --shape; got {array.shape}"
        )
    where = "--shape" if shape is not None else "nRow/nCol in the file"
    shape = shape or file_shape
    if shape is None:
        raise DatasetError(
            f"cube {spec!r} is a {array.shape[0]} x {array.shape[1]} matrix: for a bands x pixels "
            "matrix give --shape ROWS,COLS (or store nRow and nCol in the file); for an image "
            "give a (rows, cols, bands) cube"
        )
    cube, orientation = pixels_to_grid(array, shape, True if bands_first else None, name)
    rows, cols, bands = cube.shape
    return cube, (
        f"{orientation} ({array.shape[0]} x {array.shape[1]}), {rows} x {cols} from {where}, "
        f"pixels in column-major order -> {rows} x {cols} x {bands}"
    )


def abundance_labels(
    spec: str, shape: tuple[int, int], min_abundance: float = DEFAULT_MIN_ABUNDANCE
) -> tuple[np.ndarray, list[str] | None, str]:
    """A class map from abundance maps: each pixel's most abundant end-member.

    Pixels whose largest abundance is below ``min_abundance`` are unlabelled (0).

    Args:
        spec: ``FILE.mat[:KEY]`` holding end-members x pixels (column-major pixels), pixels x
            end-members, or (rows, cols, end-members); without KEY the variable ``A`` is read
            when present. Class names from ``class_names`` or ``cood`` in the same file.
        shape: (rows, cols) of the scene.
        min_abundance: in [0, 1].

    Returns:
        ``(labels, names or None, description)``: labels (rows, cols) int64, 0 = unlabelled,
        1..K = end-members.

    Raises:
        DatasetError: the file cannot be read, the array does not fit the scene, or
            ``min_abundance`` is out of range.
    """
    if not 0.0 <= min_abundance <= 1.0:
        raise DatasetError(f"min_abundance must be in [0, 1], got {min_abundance!r}")
    from common.data.convert.matfile import load_class_names

    path, key = split_spec(spec)
    if path.suffix.lower() != ".mat":
        raise DatasetError(f"--gt-abundance reads abundances from a .mat file, got {spec!r}")
    key = _data_key(path, key, prefer=(ABUNDANCE_KEY,))
    array = load_mat_array(_spec(path, key)).astype(np.float64)
    if array.ndim == 2:
        maps, orientation = pixels_to_grid(array, shape, None, _spec(path, key))
    elif array.ndim == 3 and array.shape[:2] == shape:
        maps, orientation = array, "rows x cols x end-members"
    else:
        raise DatasetError(
            f"abundances {spec!r} must be end-members x pixels or (rows, cols, end-members) "
            f"for a {shape[0]} x {shape[1]} scene, got {array.shape}"
        )
    if not np.all(np.isfinite(maps)):
        raise DatasetError(f"abundances {spec!r} contain NaN or Inf")
    labels = np.argmax(maps, axis=2).astype(np.int64) + 1
    labels[maps.max(axis=2) < min_abundance] = 0
    names = None
    for name_key in NAME_KEYS:
        names = load_class_names(path, name_key)
        if names is not None:
            break
    k = maps.shape[2]
    description = (
        f"abundances {orientation.replace('bands', 'end-members')} ({k} end-members): argmax, "
        f"unlabelled below {min_abundance:g} ({int((labels == 0).sum())} of {labels.size} pixels)"
    )
    return labels, names, description
