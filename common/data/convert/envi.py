"""ENVI scenes (.hdr + data file): the data file GDAL opens, once its header fits in it."""

from __future__ import annotations

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
        text, held = header.read_text(errors="replace"), data.stat().st_size
    except OSError as exc:
        raise DatasetError(f"cannot read ENVI file {str(path)!r}: {exc}") from exc
    pattern = r"^\s*(samples|lines|bands|header\s+offset|data\s+type)\s*=\s*(\d+)\s*$"
    found = re.findall(pattern, text, re.IGNORECASE | re.MULTILINE)
    numbers = {"header offset": 0} | {" ".join(k.lower().split()): int(v) for k, v in found}
    if len(numbers) < 5 or numbers["data type"] not in DATA_TYPES:
        return data  # GDAL says what is wrong with it
    rows, cols, bands = numbers["lines"], numbers["samples"], numbers["bands"]
    dtype = np.dtype(DATA_TYPES[numbers["data type"]])
    needed = numbers["header offset"] + rows * cols * bands * dtype.itemsize
    if min(rows, cols, bands) < 1 or needed > held:
        raise DatasetError(
            f"ENVI header of {str(path)!r} describes {rows} x {cols} x {bands} "
            f"{dtype.name} values ({needed} bytes), but its data file {str(data)!r} holds "
            f"{held} bytes"
        )
    return data
