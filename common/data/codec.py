"""How samples are stored and turned into model input (dataset format 2).

A format-2 file keeps ``/x`` in a stored dtype: float32 or float16 already normalised, or the
sensor's raw integers (uint8, uint16, int16) with ``/norm_mean`` and ``/norm_std`` applied on
read. The data service sends samples in the stored dtype (a uint16 cube travels at half the
bytes of float32) and the worker normalises them; this module is the one place that does it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from common.errors import DatasetError

FLOAT_DTYPES = ("float32", "float16")
RAW_DTYPES = ("uint8", "uint16", "int16")
STORED_DTYPES = FLOAT_DTYPES + RAW_DTYPES


@dataclasses.dataclass(frozen=True)
class SampleCodec:
    """The stored dtype of ``/x`` and, for raw samples, the per-band normalisation.

    Attributes:
        dtype: one of ``STORED_DTYPES``.
        mean, std: per-band (C,) float32 statistics; both None when the stored samples are
            already normalised (float dtypes only).
    """

    dtype: str = "float32"
    mean: np.ndarray | None = None
    std: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.dtype not in STORED_DTYPES:
            raise DatasetError(f"stored dtype {self.dtype!r} is not one of {STORED_DTYPES}")
        if (self.mean is None) != (self.std is None):
            raise DatasetError("give both norm_mean and norm_std, or neither")
        if self.raw and self.mean is None:
            raise DatasetError(f"raw {self.dtype} samples need norm_mean and norm_std")
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32)
            std = np.asarray(self.std, dtype=np.float32)
            if mean.ndim != 1 or std.shape != mean.shape:
                raise DatasetError(f"norm_mean {mean.shape} and norm_std {std.shape} must be (C,)")
            if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
                raise DatasetError("norm_mean must be finite and norm_std finite and > 0")
            object.__setattr__(self, "mean", mean)
            object.__setattr__(self, "std", std)

    @property
    def raw(self) -> bool:
        """The stored samples are raw integers, normalised on read."""
        return self.dtype in RAW_DTYPES

    @property
    def normalises(self) -> bool:
        """Reading applies ``(x - mean) / std``."""
        return self.mean is not None

    @property
    def itemsize(self) -> int:
        """Bytes per stored value."""
        return np.dtype(self.dtype).itemsize

    def check_stored(self, x: np.ndarray, shape: tuple[int, ...]) -> None:
        """Raise DatasetError unless ``x`` is (n, *shape) samples of the stored dtype."""
        if x.dtype != np.dtype(self.dtype) or x.ndim != 4 or x.shape[1:] != tuple(shape):
            raise DatasetError(
                f"samples must be {self.dtype} (n, *{tuple(shape)}), got {x.dtype} {x.shape}"
            )

    def decode(self, x: np.ndarray) -> np.ndarray:
        """Stored samples (n, C, H, W) as float32 model input."""
        out = np.asarray(x, dtype=np.float32)
        if self.mean is None or self.std is None:
            return out
        if out is x:
            out = out.copy()
        out -= self.mean[:, None, None]
        out /= self.std[:, None, None]
        return out

    def wire_stats(self) -> tuple[list[float], list[float]]:
        """``(mean, std)`` as lists for a join reply; empty when reading does not normalise."""
        if self.mean is None or self.std is None:
            return [], []
        return self.mean.tolist(), self.std.tolist()


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """Samples as a writer stores them: cast to ``dtype``, refusing a cast that would change
    values (out of range, or not integers for a raw dtype).

    Raises:
        DatasetError: the values do not fit ``dtype``.
    """
    if dtype not in STORED_DTYPES:
        raise DatasetError(f"stored dtype {dtype!r} is not one of {STORED_DTYPES}")
    x = np.asarray(x)
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        limit = float(np.finfo(np.float16).max)
        if x.size and float(np.abs(x).max()) > limit:
            raise DatasetError(f"values beyond ±{limit:g} do not fit float16")
        return np.ascontiguousarray(x, dtype=np.float16)
    info = np.iinfo(np.dtype(dtype))
    if x.size and (float(x.min()) < info.min or float(x.max()) > info.max):
        raise DatasetError(f"values outside [{info.min}, {info.max}] do not fit {dtype}")
    out = np.ascontiguousarray(x, dtype=dtype)
    if not np.issubdtype(x.dtype, np.integer) and not np.array_equal(out, x):
        raise DatasetError(f"values that are not integers cannot be stored as {dtype}")
    return out
