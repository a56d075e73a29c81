"""ENVI scenes (.hdr + data file): the data file GDAL opens, once its header fits in it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from common.errors import DatasetError

# ENVI's ``data type`` codes of numeric samples.
DATA_TYPES = {1: "uint8", 2: "int16", 3: "int32", 4: "float32", 5: "float64", 12: "uint16"}
DATA_TYPES.update({13: "uint32", 14: "int64", 15: "uint64"})
# Where a header's data file may be, as ENVI writers name it (tried in this order, any case).
DATA_SUFFIXES = ("", ".img", ".dat", ".sli", ".hyspex", ".raw", ".bsq", ".bil", ".bip")


def envi_data_file(path: Path) -> Path:
    """The data file of an ENVI scene, checked against its header.

    A header whose dimensions need more bytes than the data file holds is refused: a damaged
    or hostile header would otherwise size arrays of terabytes.

    Args:
        path: the .hdr or the data file beside it.

    Returns:
        The data file.

    Raises:
        DatasetError: the header or the data file is missing, or the header describes more
            data than the file holds.
    """
    if path.suffix.lower() == ".hdr":
        header = path
        beside = [path.with_suffix(s) for x in DATA_SUFFIXES for s in (x, x.upper())]
        data = next((p for p in beside if p.is_file()), None)
        if data is None:
            raise DatasetError(f"no ENVI data file found beside {str(path)!r}")
    else:
        data, header = path, path.with_suffix(".hdr")
        if not header.is_file():
            header = Path(str(path) + ".hdr")
    try:
        text = header.read_text(errors="replace")
    except OSError as exc:
        raise DatasetError(f"cannot read ENVI file {str(path)!r}: {exc}") from exc
    pattern = r"^\s*(samples|lines|bands|header\s+offset|data\s+type)\s*=\s*(\d+)\s*$"
    found = re.findall(pattern, text, re.IGNORECASE | re.MULTILINE)
    numbers = {"header offset": 0} | {" ".join(k.lower().split()): int(v) for k, v in found}
    if len(numbers) < 5 or numbers["data type"] not in DATA_TYPES:
        return data  # GDAL says what is wrong with it
    shape = (numbers["lines"], numbers["samples"], numbers["bands"])
    check_size(
        path, data, shape, np.dtype(DATA_TYPES[numbers["data type"]]), numbers["header offset"]
    )
    return data


def check_size(
    path: Path, data: Path, shape: tuple[int, int, int], dtype: np.dtype, offset: int | str
) -> None:
    """Refuse an ENVI scene whose (rows, cols, bands) of ``dtype`` after ``offset`` bytes need
    more bytes than its data file holds; run on the header as read here and again on what
    GDAL opened.

    Raises:
        DatasetError: the header offset is not a number, the data file cannot be read, or the
            header describes more data than the file holds.
    """
    try:
        needed = int(offset) + math.prod(shape) * dtype.itemsize
        held = data.stat().st_size
    except (ValueError, OSError) as exc:
        raise DatasetError(f"cannot read ENVI file {str(path)!r}: {exc}") from exc
    if min(shape) < 1 or needed > held:
        raise DatasetError(
            f"ENVI header of {str(path)!r} describes {' x '.join(map(str, shape))} "
            f"{dtype.name} values ({needed} bytes), but its data file {str(data)!r} holds "
            f"{held} bytes"
        )
