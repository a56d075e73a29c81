"""Reading files a user or another process may have planted: only regular files, of a bounded
size, and ``.npz`` archives whose arrays are sized by their headers before any is allocated.

A FIFO or a device (``/dev/zero``) at a file's name would block or never end a read; an
``.npy`` header is untrusted text, so absurd dimensions must be refused before numpy
allocates them (a MemoryError, or gigabytes, otherwise).
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO

import numpy as np
from numpy.lib import format as npy_format


class UnsafeFileError(ValueError):
    """The file is not a regular file, is too large, or holds arrays its size cannot hold."""


@contextlib.contextmanager
def open_regular(path: Path, max_bytes: int) -> Iterator[BinaryIO]:
    """Open ``path`` for reading if it is a regular file of at most ``max_bytes``.

    The check is made on the opened file (``fstat``), so a FIFO swapped in after a check of
    the name cannot block the reader; the open itself never blocks (``O_NONBLOCK``).

    Args:
        path: the file (symbolic links are followed; their target is checked).
        max_bytes: the largest size accepted.

    Yields:
        The file, opened in binary mode.

    Raises:
        FileNotFoundError: there is no such file.
        UnsafeFileError: it is not a regular file, or larger than ``max_bytes``.
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{str(path)!r} is not a regular file")
        if info.st_size > max_bytes:
            raise UnsafeFileError(f"{str(path)!r} has {info.st_size} bytes, at most {max_bytes}")
        os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


def read_npz(
    path: Path, max_bytes: int, members: dict[str, int], skip: frozenset[str] = frozenset()
) -> dict[str, np.ndarray]:
    """Read the arrays of an ``.npz`` archive, each sized by its header before it is loaded.

    Args:
        path: the archive (a regular file of at most ``max_bytes``).
        max_bytes: the largest file accepted.
        members: the arrays expected, each with the most bytes its data may take; the archive
            must hold exactly these.
        skip: arrays whose header is checked but whose data is not read (returned empty).

    Returns:
        Each array by name.

    Raises:
        FileNotFoundError: there is no such file.
        UnsafeFileError: not a regular file, too large, other members, or an array whose
            header is malformed, names an object dtype or needs more bytes than allowed or
            than the member holds.
        OSError, zipfile.BadZipFile: the archive cannot be read.
    """
    arrays = {}
    with open_regular(path, max_bytes) as handle, zipfile.ZipFile(handle) as archive:
        names = {f"{name}.npy": name for name in members}
        found = sorted(info.filename for info in archive.infolist())
        if found != sorted(names):
            raise UnsafeFileError(f"unexpected members {found[:4]}")
        for info in archive.infolist():
            name = names[info.filename]
            with archive.open(info) as member:
                shape, dtype = _header(member, info.filename)
                needed = math.prod(shape) * dtype.itemsize
                if needed > members[name] or needed > info.file_size:
                    raise UnsafeFileError(
                        f"{info.filename} declares {shape} {dtype} ({needed} bytes); "
                        f"{min(members[name], info.file_size)} bytes at most"
                    )
                if name in skip:
                    arrays[name] = np.zeros(0, dtype=dtype)
                    continue
                data = member.read(needed + 1)
            if len(data) != needed:
                raise UnsafeFileError(f"{info.filename} holds {len(data)} bytes, not {needed}")
            arrays[name] = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return arrays


def _header(member: IO[bytes], name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an ``.npy`` member's header declares (C order, no objects)."""
    try:
        version = npy_format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(member)
        else:
            raise UnsafeFileError(f"{name}: .npy version {version} is not read")
    except (ValueError, EOFError) as exc:
        if isinstance(exc, UnsafeFileError):
            raise
        raise UnsafeFileError(f"{name}: malformed .npy header: {exc}") from exc
    if dtype.hasobject:
        raise UnsafeFileError(f"{name}: object arrays are not read (they would unpickle)")
    if fortran or any(n < 0 for n in shape):
        raise UnsafeFileError(f"{name}: {dtype} {shape} (Fortran order: {fortran}) is not read")
    return tuple(int(n) for n in shape), dtype
