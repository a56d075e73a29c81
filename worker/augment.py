"""Seeded, reproducible batch augmentation for overhead imagery: dihedral transforms and noise."""

from __future__ import annotations

import hashlib
import math
import struct

import torch

from common.errors import ConfigError

# A dihedral transform is coded d = 4 * flip + k: flip the width axis when ``flip``, then
# rotate by k * 90 degrees in the (H, W) plane. The eight codes are the symmetries of a square.
DIHEDRAL = tuple(range(8))
# The subgroups the options allow. Flipping both axes equals rotating by 180 degrees (code 2),
# and a horizontal flip followed by a half turn is a vertical flip (code 6); both keep H x W, so
# they are valid on non-square images too. Quarter turns (codes 1, 3, 5, 7) need H == W.
_FLIPS = (0, 2, 4, 6)
_HALF_TURN = (0, 2)
_ROTATIONS = (0, 1, 2, 3)


def dihedral(x: torch.Tensor, code: int) -> torch.Tensor:
    """Apply dihedral transform ``code`` to the last two axes of ``x``.

    Args:
        x: a tensor (..., H, W); codes 1, 3, 5 and 7 swap H and W.
        code: 0..7, ``4 * flip + k`` (flip the width axis, then rotate by k quarter turns).

    Returns:
        The transformed tensor (a new tensor, except for code 0, which returns ``x``).

    Raises:
        ValueError: ``code`` is not in 0..7.
    """
    if code not in DIHEDRAL:
        raise ValueError(f"dihedral code must be in 0..7, got {code!r}")
    if code >= 4:
        x = torch.flip(x, dims=(-1,))
    k = code % 4
    return torch.rot90(x, k, dims=(-2, -1)) if k else x


def _generator(seed: int, step_key: int) -> torch.Generator:
    """A CPU generator whose state depends only on ``(seed, step_key)``, well mixed."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, step_key), digest_size=8).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


class Augmenter:
    """Random flips, quarter turns and spectral noise on batches (n, C, H, W).

    The randomness of each call comes from a fresh generator seeded from ``(seed, step_key)``,
    so the same task (``step_key`` = task id) always gets the same augmentation, whatever the
    timing, thread or device. Each sample gets one transform drawn uniformly from the allowed
    dihedral subgroup (all 8 with flips and rotations on square images; {identity, horizontal,
    vertical, both flips} with flips only or on non-square images; quarter turns with rotations
    only; identity or half turn with rotations only on non-square images), and samples are
    transformed in at most 8 vectorised groups. Spectral noise adds one Gaussian offset per
    sample and band (the same over all pixels), with standard deviation ``noise`` in the units
    of the normalised data (unit per-band variance), so it perturbs each sample's spectrum.

    Args:
        seed: the run's seed (``JoinReply.seed``).
        flips: draw random horizontal and vertical flips.
        rotations: draw random rotations by multiples of 90 degrees (quarter turns only when
            H == W).
        noise: standard deviation of the per-sample, per-band offset; 0 disables it.

    Raises:
        ConfigError: ``noise`` is negative or not finite.
    """

    def __init__(
        self, seed: int, flips: bool = True, *, rotations: bool = True, noise: float = 0.0
    ) -> None:
        if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
            raise ConfigError(f"augmentation noise must be a finite number >= 0, got {noise!r}")
        self.seed, self.flips, self.rotations, self.noise = int(seed), flips, rotations, noise

    def __repr__(self) -> str:
        return (
            f"Augmenter(seed={self.seed}, flips={self.flips}, rotations={self.rotations}, "
            f"noise={self.noise})"
        )

    def codes_allowed(self, height: int, width: int) -> tuple[int, ...]:
        """The dihedral codes this augmenter draws from for images of ``height`` x ``width``.

        Args:
            height: H.
            width: W.

        Returns:
            A tuple of codes in 0..7, always containing 0 (the identity).
        """
        square = height == width
        if self.flips and self.rotations and square:
            return DIHEDRAL
        if self.flips:
            return _FLIPS
        if self.rotations:
            return _ROTATIONS if square else _HALF_TURN
        return (0,)

    def draw(
        self, shape: tuple[int, ...] | torch.Size, step_key: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The random choices for one batch, without applying them.

        Args:
            shape: the batch shape (n, C, H, W).
            step_key: the key of this batch (the task id).

        Returns:
            ``(codes, offsets)``: int64 (n,) dihedral codes and float32 (n, C, 1, 1) spectral
            offsets already scaled by ``noise`` (None when ``noise`` is 0), both on the CPU.
        """
        n, c, h, w = shape
        gen = _generator(self.seed, step_key)
        # Codes first, noise second, always from the CPU generator, so the draws do not
        # depend on the device the batch lives on.
        allowed = torch.tensor(self.codes_allowed(h, w), dtype=torch.int64)
        codes = allowed[torch.randint(len(allowed), (n,), generator=gen)]
        offsets = None
        if self.noise > 0:
            offsets = self.noise * torch.randn((n, c, 1, 1), generator=gen, dtype=torch.float32)
        return codes, offsets

    def __call__(self, x: torch.Tensor, step_key: int) -> torch.Tensor:
        """Augment a batch.

        Args:
            x: float tensor (n, C, H, W) on any device; it is not modified.
            step_key: the key of this batch, e.g. the task id; the same key gives the same
                augmentation.

        Returns:
            A new tensor of the same shape, dtype and device (``x`` itself when nothing is
            enabled or the batch is empty).

        Raises:
            ValueError: ``x`` is not a 4-D floating-point tensor.
        """
        if x.ndim != 4 or not x.is_floating_point():
            raise ValueError(
                f"augmentation needs a float tensor (n, C, H, W), got {x.dtype} {tuple(x.shape)}"
            )
        if x.shape[0] == 0 or (self.codes_allowed(*x.shape[2:]) == (0,) and self.noise == 0):
            return x
        codes, offsets = self.draw(x.shape, step_key)
        out = torch.empty_like(x)
        for code in torch.unique(codes).tolist():
            rows = torch.nonzero(codes == code).squeeze(1).to(x.device)
            out[rows] = dihedral(x.index_select(0, rows), code)
        if offsets is not None:
            out += offsets.to(device=x.device, dtype=x.dtype)
        return out
