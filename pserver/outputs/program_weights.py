"""Reading a ``pserver export`` program file without running anything it holds.

``torch.export.load`` is not safe on a file from someone else (torch 2.13): weights or
constants marked ``use_pickle`` are read with ``torch.load(weights_only=False)``, opaque
constants are unpickled, sample inputs fall back to ``weights_only=False`` when the
safe load fails, symbolic shapes in ``models/model.json`` go through ``sympy.sympify`` (an
``eval``), and ``data/aotinductor/`` members are shared libraries it loads. So the project reads
only two kinds of member itself: JSON (the metadata and the weights' layout) and raw tensor
bytes. The module is then rebuilt from the model's name, as for the state-dict format. An
archive holding any member a ``pserver export`` program never holds (pickled or legacy
weights, custom objects, compiled code) is refused before anything is read.
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ModelError

META_MEMBER = "extra/meta.json"
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
_MEMBERS = re.compile(
    r"^(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/model\.json|data/sample_inputs/model\.pt|extra/meta\.json"
    r"|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+)$"
)
# torch.export's ScalarType codes (torch/_export/serde/schema.py) of the dtypes models hold.
_DTYPES: dict[int, np.dtype[Any]] = {
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f2"),
    7: np.dtype("<f4"),
    8: np.dtype("<f8"),
    12: np.dtype("?"),
}
_BFLOAT16 = 13
MAX_JSON_BYTES = 64 << 20


def _refuse(path: Path, why: str) -> ModelError:
    return ModelError(f"model file {str(path)!r} is refused: {why}")


def _read(archive: zipfile.ZipFile, name: str, limit: int, path: Path) -> bytes:
    """A member no larger than ``limit`` bytes (as declared; zipfile never inflates more
    than that), its checksum verified."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise _refuse(path, f"it lacks {name.split('/', 1)[1]!r}") from None
    if info.file_size > limit:
        raise _refuse(path, f"{name!r} is {info.file_size} bytes")
    try:
        return archive.read(info)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        raise _refuse(path, f"{name!r} cannot be read ({first_line(exc)})") from None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (at most 200 characters), or its type's name."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _int(value: Any, what: str, path: Path) -> int:
    """A plain integer of the archive's JSON (``{"as_int": n}``); symbolic values are refused."""
    if isinstance(value, dict) and set(value) == {"as_int"}:
        value = value["as_int"]
    if type(value) is not int or value < 0:
        raise _refuse(path, f"{what} is not a whole number >= 0")
    return value


def _tensor(
    archive: zipfile.ZipFile, root: str, fqn: str, entry: Any, shape: tuple[int, ...], path: Path
) -> torch.Tensor:
    """One weight from its raw bytes and its layout, checked to be ``shape`` and to lie within
    a record no larger than the layout reaches (checked before the record is read)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("tensor_meta"), dict):
        raise _refuse(path, f"weight {fqn!r} has no tensor layout")
    if entry.get("use_pickle") is not False:
        raise _refuse(path, f"weight {fqn!r} is stored with pickle")
    name = entry.get("path_name")
    if not isinstance(name, str) or not re.fullmatch(r"weight_\d+", name):
        raise _refuse(path, f"weight {fqn!r} names no weight record")
    meta = entry["tensor_meta"]
    code = meta.get("dtype")
    if code not in _DTYPES and code != _BFLOAT16:
        raise _refuse(path, f"weight {fqn!r} has an unsupported dtype code {str(code)[:20]}")
    sizes = [_int(s, f"a size of {fqn!r}", path) for s in meta.get("sizes", [])]
    strides = [_int(s, f"a stride of {fqn!r}", path) for s in meta.get("strides", [])]
    offset = _int(meta.get("storage_offset"), f"the offset of {fqn!r}", path)
    if len(sizes) != len(strides) or tuple(sizes) != shape:
        raise _refuse(path, f"weight {fqn!r} has not the layout of a {list(shape)} tensor")
    dtype: np.dtype[Any] = _DTYPES.get(code, np.dtype("<u2"))
    if 0 in sizes:
        return torch.zeros(sizes, dtype=torch.bfloat16 if code == _BFLOAT16 else None)
    reach = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) + 1
    if 0 in (s for n, s in zip(sizes, strides, strict=True) if n > 1):
        raise _refuse(path, f"weight {fqn!r} repeats values (a stride of 0)")
    data = _read(archive, f"{root}/data/weights/{name}", reach * dtype.itemsize, path)
    if len(data) % dtype.itemsize or len(data) // dtype.itemsize < reach:
        raise _refuse(path, f"weight {fqn!r} reaches beyond its record")
    flat = torch.from_numpy(np.frombuffer(data, dtype=dtype).copy())
    if code == _BFLOAT16:
        flat = flat.view(torch.bfloat16)
    return torch.as_strided(flat, sizes, strides, offset).clone()


def read_program(
    path: Path, shapes: Callable[[Any], dict[str, tuple[int, ...]]]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The metadata and the weights of a program file, read without torch's loader.

    Args:
        path: a zip archive written by ``torch.export.save``.
        shapes: checks the metadata and gives the shape of every weight the model it names
            has (raising ``ModelError`` for metadata it refuses); no record is read before.

    Returns:
        The ``pserver export`` metadata and the state dict by name.

    Raises:
        ModelError: an unexpected member (pickled or legacy weights, custom objects, compiled
            code), a weight stored with pickle, with a symbolic or out-of-range layout or
            another shape than the model's, a member that cannot be read (a bad checksum),
            malformed or too deeply nested JSON, a big-endian archive, or no metadata.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise _refuse(path, f"not a zip archive ({exc})") from None
    with archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        roots = {n.split("/", 1)[0] for n in names}
        if len(roots) != 1 or any("/" not in n for n in names):
            raise _refuse(path, "not a torch.export archive (one top folder)")
        root = roots.pop()
        for name in names:
            if not _MEMBERS.match(name[len(root) + 1 :]):
                raise _refuse(
                    path,
                    f"it holds {name!r}, which a 'pserver export' program never holds "
                    "(pickled objects or compiled code are not loaded)",
                )
        if _read(archive, f"{root}/byteorder", 16, path) != b"little":
            raise _refuse(path, "its weights are not little-endian")
        try:
            meta = json.loads(_read(archive, f"{root}/{META_MEMBER}", MAX_JSON_BYTES, path))
            config = json.loads(_read(archive, f"{root}/{WEIGHTS_CONFIG}", MAX_JSON_BYTES, path))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _refuse(path, f"malformed JSON ({first_line(exc)})") from None
        entries = config.get("config") if isinstance(config, dict) else None
        if not isinstance(entries, dict):
            raise _refuse(path, "its weights have no layout")
        expected = shapes(meta)
        if set(entries) != set(expected):
            raise _refuse(path, "its weights are not those of the model it names")
        state = {
            fqn: _tensor(archive, root, fqn, entry, expected[fqn], path)
            for fqn, entry in entries.items()
        }
    return meta, state
