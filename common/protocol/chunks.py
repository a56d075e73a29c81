"""How the flat state is cut into shard ranges and wire chunks, and its wire formats.

The flat state (parameters, then float buffers) is split into K contiguous shard ranges of
about equal size and each range into chunks of about ``chunk_bytes`` on the wire. Every
boundary is a multiple of ``ALIGN`` elements, so a slice starts where a vectorised loop over the
whole vector would be at the start of a vector: element-wise arithmetic on a slice then rounds
exactly as on the whole vector, and a sharded update equals the unsharded one bit for bit.

Wire formats: ``fp32`` as is; ``bf16`` (bfloat16, fp32's range, 8-bit mantissa, round to
nearest even); ``fp16`` with a power-of-two scale per chunk so that small gradients do not
underflow and large values do not overflow. The receiver multiplies by ``1 / scale``.
"""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import torch

from common.errors import ErrorCode, ProtocolError
from common.protocol.wire import BFloat16Array, bfloat16_words

ALIGN = 1024
_FP16_TARGET = 2.0**14  # scale chunks so that their largest magnitude lands near here
_FP16_MAX_EXPONENT = 40


def shard_bounds(size: int, shards: int) -> list[int]:
    """Boundaries of ``shards`` contiguous ranges over ``size`` elements, about equal in bytes.

    Returns:
        ``shards + 1`` increasing offsets from 0 to ``size``; inner ones multiples of ALIGN.
        Ranges may be empty when the state is smaller than ``shards * ALIGN``.
    """
    bounds = [0]
    for k in range(1, shards):
        cut = round(size * k / shards / ALIGN) * ALIGN
        bounds.append(min(max(cut, bounds[-1]), size))
    bounds.append(size)
    return bounds


def chunk_spans(lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
    """The chunks ``[(start, stop), ...]`` covering ``[lo, hi)``; inner cuts aligned."""
    step = max(ALIGN, chunk_elems // ALIGN * ALIGN)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def chunk_elems_for(chunk_bytes: int, wire: str) -> int:
    """Elements per chunk for about ``chunk_bytes`` on the wire (a multiple of ALIGN)."""
    itemsize = 4 if wire == "fp32" else 2  # bytes per element on the wire
    return max(ALIGN, chunk_bytes // itemsize // ALIGN * ALIGN)


def _fp16_scale(values: torch.Tensor) -> float:
    amax = float(values.abs().max()) if values.numel() else 0.0
    if amax == 0.0 or not math.isfinite(amax):
        return 1.0
    exponent = math.floor(math.log2(_FP16_TARGET / amax))
    return 2.0 ** max(-_FP16_MAX_EXPONENT, min(_FP16_MAX_EXPONENT, exponent))


def encode(values: torch.Tensor, wire: str) -> tuple[np.ndarray, float]:
    """A float32 vector in wire format.

    Args:
        values: 1-D float32 CPU tensor (not modified).
        wire: ``fp32``, ``bf16`` or ``fp16``.

    Returns:
        The array to send and its scale (1.0 except for fp16).
    """
    if wire == "fp32":
        return values.numpy(), 1.0
    if wire == "bf16":
        words = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return bfloat16_words(words), 1.0
    scale = _fp16_scale(values)
    return (values * scale).to(torch.float16).numpy(), scale


def check_scale(scale: float, dtype: torch.dtype) -> None:
    """Refuse a chunk's scale that its wire format does not produce: fp32 and bf16 chunks
    carry 1.0; fp16 chunks a power of two within 2^±40 (what ``encode`` sends). So a norm
    taken of the wire values divided by the scale is the norm of what is applied.

    Raises:
        ProtocolError: BAD_FIELD.
    """
    if dtype != torch.float16:
        if scale != 1.0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"scale {scale} must be 1 for {dtype}")
        return
    mantissa, exponent = math.frexp(scale)
    if mantissa != 0.5 or abs(exponent - 1) > _FP16_MAX_EXPONENT:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"scale {scale} is not a power of two within 2^±{_FP16_MAX_EXPONENT}",
        )


def as_tensor(data: np.ndarray, wire: str, what: str) -> torch.Tensor:
    """A received wire array as a (read-only) tensor of its own dtype, checked against ``wire``.

    Raises:
        ProtocolError: BAD_TENSOR if the array is not 1-D in the run's wire format.
    """
    expected = {"fp32": np.float32, "fp16": np.float16}.get(wire)
    matches = (
        isinstance(data, BFloat16Array) if wire == "bf16" else data.dtype == expected
    ) and not (wire != "bf16" and isinstance(data, BFloat16Array))
    if not matches or data.ndim != 1:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{what} must be a 1-D {wire} tensor, got {data.dtype} {tuple(data.shape)}",
        )
    raw = np.asarray(data).view(np.int16) if wire == "bf16" else np.asarray(data)
    tensor = _readonly_tensor(raw)
    return tensor.view(torch.bfloat16) if wire == "bf16" else tensor


def decode_into(data: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Write a wire tensor (from ``as_tensor``), divided by ``scale``, into float32 ``out``."""
    out.copy_(data)  # upcast first: scaling in float16 would underflow
    if scale != 1.0:
        out.mul_(1.0 / scale)


class _ReadOnlyWarning:
    """Whether torch may still warn that an array is not writable: it warns once per process,
    so once a conversion under watch warned nothing, later ones need no ``catch_warnings``
    (whose cost per call exceeds the conversion's). ``catch_warnings`` swaps the process's
    warning filters and restores what it found, so conversions under watch take ``lock``: two
    at once in two threads could leave one's filters in place for good."""

    possible = True
    lock = threading.Lock()


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    if not _ReadOnlyWarning.possible or array.flags.writeable:
        return torch.from_numpy(array)  # nothing to silence
    with _ReadOnlyWarning.lock:
        with warnings.catch_warnings(record=True) as caught:  # a received frame is never written
            warnings.simplefilter("always", UserWarning)
            tensor = torch.from_numpy(array)
        _ReadOnlyWarning.possible = bool(caught)
    return tensor
