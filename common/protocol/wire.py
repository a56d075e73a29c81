"""Frame codec: a msgpack header frame followed by raw tensor frames (see docs/protocol.md)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from common.errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 5
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 8
MAX_NDIM = 8
BFLOAT16 = "bfloat16"
WIRE_DTYPES = ("fp32", "bf16", "fp16")  # formats of gradients and parameters on the wire
# Only plain numeric dtypes may cross the wire; object, string and void dtypes never do.
# bfloat16 has no numpy dtype: it travels as 16-bit words, tagged by ``BFloat16Array``.
ALLOWED_DTYPES = frozenset(
    {BFLOAT16, "float16", "float32", "float64"}
    | {f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)}
)


class BFloat16Array(np.ndarray):
    """A uint16 array whose words are bfloat16 values (the wire tags it ``bfloat16``)."""


def bfloat16_words(words: np.ndarray) -> BFloat16Array:
    """Tag a uint16 array as bfloat16 for the wire (no copy)."""
    if words.dtype != np.uint16:
        raise TypeError(f"bfloat16 words must be uint16, got {words.dtype}")
    return words.view(BFloat16Array)


@functools.cache
def _numpy_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype of a wire dtype name."""
    return np.dtype(np.uint16 if name == BFLOAT16 else name).newbyteorder("<")


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # a slow property: worth a lookup table


def encode_frames(header: dict[str, Any], tensors: Sequence[np.ndarray] = ()) -> list[Any]:
    """Build the frames of one message.

    Args:
        header: JSON-like map; ``v`` and ``tensors`` are filled in here.
        tensors: numeric arrays, each sent as one raw frame (C order, native little-endian).

    Returns:
        ``[header_bytes, tensor_0, ...]`` ready for ``send_multipart(copy=False)``.

    Raises:
        ProtocolError: a tensor has a dtype that may not cross the wire.
    """
    descriptors = []
    payload: list[Any] = []
    for array in tensors:
        name = BFLOAT16 if isinstance(array, BFloat16Array) else _dtype_name(array.dtype)
        array = np.ascontiguousarray(array)
        if name not in ALLOWED_DTYPES or array.dtype.byteorder == ">":
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"dtype {array.dtype!s} cannot be sent")
        descriptors.append({"dtype": name, "shape": list(array.shape)})
        payload.append(array.reshape(-1).view(np.uint8).data if array.size else b"")
    full = dict(header)
    full["v"] = PROTOCOL_VERSION
    full["tensors"] = descriptors
    return [msgpack.packb(full, use_bin_type=True), *payload]


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else memoryview(frame)


def decode_frames(frames: Sequence[Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Parse and validate the frames of one message.

    Args:
        frames: header frame then tensor frames (bytes or ``zmq.Frame``), routing identity removed.

    Returns:
        The header map and the tensors as read-only arrays that share the frames' memory
        (``bfloat16`` tensors as ``BFloat16Array``).

    Raises:
        ProtocolError: the frames are not a well-formed message of this protocol version.
    """
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty message")
    raw = _buffer(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header of {len(raw)} bytes exceeds the cap")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"header must be a map, got {type(header).__name__}"
        )
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"protocol version {version!r} differs from {PROTOCOL_VERSION}"
        )
    descriptors = header.get("tensors", [])
    if not isinstance(descriptors, list) or len(descriptors) > MAX_TENSORS:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "'tensors' must be a list of descriptors")
    if len(descriptors) != len(frames) - 1:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"header describes {len(descriptors)} tensors but {len(frames) - 1} frames follow",
        )
    arrays = [
        _decode_tensor(d, _buffer(f), i)
        for i, (d, f) in enumerate(zip(descriptors, frames[1:], strict=True))
    ]
    return header, arrays


def _decode_tensor(desc: Any, buf: memoryview, index: int) -> np.ndarray:
    if not isinstance(desc, dict):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor {index}: descriptor is not a map")
    dtype, shape = desc.get("dtype"), desc.get("shape")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor {index}: dtype {dtype!r} not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(n) is int and 0 <= n < 1 << 40 for n in shape)
    ):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor {index}: bad shape {shape!r}")
    numpy_dtype = _numpy_dtype(dtype)
    itemsize = numpy_dtype.itemsize
    expected = math.prod(shape) * itemsize
    if buf.nbytes != expected:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"tensor {index}: frame has {buf.nbytes} bytes, dtype {dtype} x shape {shape} "
            f"needs {expected}",
        )
    array = np.frombuffer(buf, dtype=numpy_dtype).reshape(shape)
    return array.view(BFloat16Array) if dtype == BFLOAT16 else array
