"""Reading MATLAB .mat files: v5 (scipy) and v7.3 (HDF5, via h5py), arrays and class names."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import scipy.io

from common.errors import DatasetError

log = logging.getLogger(__name__)

_NUMERIC = {
    "double",
    "single",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "logical",
}
_V73_MAGIC = b"MATLAB 7.3"


def split_spec(spec: str) -> tuple[Path, str | None]:
    """Split ``FILE.mat[:KEY]`` into the file path and the optional key.

    Args:
        spec: a file path, optionally followed by ``:KEY``.

    Returns:
        ``(path, key)``; key is None when omitted.

    Raises:
        DatasetError: the spec is empty.
    """
    if not spec:
        raise DatasetError("empty .mat spec: expected FILE.mat[:KEY]")
    if os.path.exists(spec) or ":" not in spec:
        return Path(spec), None
    path, key = spec.rsplit(":", 1)
    if not path or "/" in key or "\\" in key:
        return Path(spec), None
    return Path(path), key or None


def _is_v73(path: Path) -> bool:
    """True when the file is a MATLAB v7.3 (HDF5) file."""
    with path.open("rb") as fh:
        head = fh.read(len(_V73_MAGIC))
    return head == _V73_MAGIC or h5py.is_hdf5(path)


def _h5_class(obj: h5py.Dataset) -> str:
    """MATLAB class of a v7.3 dataset, inferred from the dtype when the attribute is missing."""
    cls = obj.attrs.get("MATLAB_class")
    if cls is not None:
        return cls.decode() if isinstance(cls, bytes) else str(cls)
    if obj.dtype.kind in "biuf":
        return "double" if obj.dtype.kind == "f" else "int64"
    return "unknown"


def mat_variables(path: str | os.PathLike[str]) -> list[tuple[str, tuple[int, ...], str]]:
    """List a .mat file's variables without loading them.

    Args:
        path: a MATLAB file (v4–v7.2 or v7.3).

    Returns:
        ``[(name, shape, matlab_class), ...]``; shapes in MATLAB order (rows, cols, ...).

    Raises:
        DatasetError: the file is missing or not a MAT file.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"MAT file {str(path)!r} does not exist")
    if not _is_v73(path):
        try:
            return [(n, tuple(s), c) for n, s, c in scipy.io.whosmat(path)]
        except NotImplementedError:
            pass
        except Exception as exc:
            raise DatasetError(f"{str(path)!r} is not a readable MAT file: {exc}") from exc
    try:
        with h5py.File(path, "r") as f:
            return [
                (name, tuple(reversed(obj.shape)), _h5_class(obj))
                for name, obj in f.items()
                if isinstance(obj, h5py.Dataset) and not name.startswith("#")
            ]
    except OSError as exc:
        raise DatasetError(f"{str(path)!r} is not a readable MAT v7.3 file: {exc}") from exc


def _pick_key(path: Path, key: str | None, variables: list[tuple[str, Any, str]]) -> str:
    """Choose the variable to load, or raise an error listing what the file holds."""
    found = ", ".join(f"{n} {'x'.join(map(str, s))} {c}" for n, s, c in variables) or "none"
    if key is not None:
        match = [v for v in variables if v[0] == key]
        if not match:
            raise DatasetError(f"key {key!r} not found in {str(path)!r}; keys found: {found}")
        if match[0][2] not in _NUMERIC:
            raise DatasetError(
                f"key {key!r} in {str(path)!r} is a {match[0][2]}, not a numeric array"
            )
        return key
    numeric = [n for n, _, c in variables if c in _NUMERIC and not n.startswith("__")]
    if len(numeric) != 1:
        raise DatasetError(
            f"{str(path)!r} holds {len(numeric)} numeric arrays, so give FILE.mat:KEY; "
            f"keys found: {found}"
        )
    return numeric[0]


def load_mat_array(spec: str) -> np.ndarray:
    """Load one numeric array from ``FILE.mat[:KEY]`` in MATLAB's axis order.

    MATLAB <= 7.2 files are read with scipy, v7.3 (HDF5) files with h5py, transposed back
    to (rows, cols, ...). Without KEY the file must hold exactly one numeric array.

    Args:
        spec: ``FILE.mat`` or ``FILE.mat:KEY``.

    Returns:
        The array, e.g. (rows, cols, bands) for a cube.

    Raises:
        DatasetError: the file is missing or unreadable, KEY is absent (the message lists the
            keys found) or not numeric, or KEY is omitted and the choice is ambiguous.
    """
    path, key = split_spec(spec)
    variables = mat_variables(path)
    key = _pick_key(path, key, variables)
    try:
        if _is_v73(path):
            with h5py.File(path, "r") as f:
                arr = np.asarray(f[key][...]).T
        else:
            arr = scipy.io.loadmat(path, variable_names=[key])[key]
    except (OSError, ValueError, KeyError) as exc:
        raise DatasetError(f"cannot read key {key!r} from {str(path)!r}: {exc}") from exc
    if arr.dtype.kind not in "biuf":
        raise DatasetError(f"key {key!r} in {str(path)!r} has non-numeric dtype {arr.dtype}")
    log.debug("loaded %s:%s %s %s", path, key, arr.shape, arr.dtype)
    return arr


def _h5_strings(f: h5py.File, obj: h5py.Dataset) -> list[str]:
    """Decode a v7.3 char matrix, cell array of chars, or plain HDF5 string dataset."""
    cls = obj.attrs.get("MATLAB_class")
    cls = cls.decode() if isinstance(cls, bytes) else cls
    data = obj[...]
    if obj.dtype.kind in "OSU" and cls != "cell":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in np.ravel(data)]
    if cls == "cell" or obj.dtype == h5py.ref_dtype:
        names: list[str] = []
        for ref in np.ravel(data):
            names.extend(_h5_strings(f, f[ref]))
        return names
    codes = np.atleast_2d(np.asarray(data)).T  # back to MATLAB's (rows, chars)
    return ["".join(chr(int(c)) for c in row if int(c)).strip() for row in codes]


def _to_strings(value: Any) -> list[str]:
    """Flatten what scipy gives for a cellstr or char matrix into a list of strings."""
    arr = np.asarray(value)
    if arr.dtype.kind == "U":
        return [str(s).strip() for s in arr.ravel()]
    if arr.dtype == object:
        out: list[str] = []
        for item in arr.ravel():
            out.extend(_to_strings(item))
        return out
    raise DatasetError(f"expected strings, got an array of {arr.dtype}")


def load_class_names(path: str | os.PathLike[str], key: str = "class_names") -> list[str] | None:
    """Read a list of class names stored in a .mat file, if there is one.

    Args:
        path: the MAT file (usually the ground-truth file).
        key: the variable holding a cell array or char matrix of names.

    Returns:
        The names, or None when the file has no such variable.

    Raises:
        DatasetError: the variable exists but does not hold strings.
    """
    path = Path(path)
    if key not in [n for n, _, _ in mat_variables(path)]:
        return None
    try:
        if _is_v73(path):
            with h5py.File(path, "r") as f:
                return _h5_strings(f, f[key])
        return _to_strings(scipy.io.loadmat(path, variable_names=[key])[key])
    except (DatasetError, OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{key!r} in {str(path)!r} does not hold strings: {exc}") from exc
