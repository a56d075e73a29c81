"""Synthetic remote-sensing datasets: a hyperspectral scene and EuroSAT-shaped image sets."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
from scipy.ndimage import gaussian_filter

from common.data.convert.hsi import write_patch_dataset
from common.data.dataset import DatasetMeta
from common.data.splits import stratified_split
from common.data.writer import write_scenes
from common.errors import DatasetError

log = logging.getLogger(__name__)

SCENE_BLOCK = 256  # images generated at a time
WRITE_BLOCK = 32  # images normalised and written at a time (beside the generated block)
# Difficulty of the scenes, tuned so scene-cnn is near 0.5 after one epoch and above 0.85
# after a few (see docs/data.md): angle jitter (radians), distractor texture strength,
# texture strength, pixel noise, spread of the spectral signatures.
_ANGLE_JITTER = 0.3
_DISTRACT = 0.7
_TEXTURE = 0.5
_NOISE = 1.2
_SPECTRAL = 0.15


def _check_positive(**values: int | None) -> None:
    """Raise DatasetError naming the first argument that is not a positive integer."""
    for name, value in values.items():
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise DatasetError(f"{name} must be a positive integer, got {value!r}")


def _smooth_curves(rng: np.random.Generator, n: int, bands: int, bumps: int) -> np.ndarray:
    """n smooth curves over ``bands`` points: sums of Gaussian bumps, zero mean, unit max."""
    lam = np.linspace(0.0, 1.0, bands)
    centres = rng.uniform(-0.1, 1.1, size=(n, bumps, 1))
    widths = rng.uniform(0.06, 0.25, size=(n, bumps, 1))
    heights = rng.normal(size=(n, bumps, 1))
    curves = (heights * np.exp(-0.5 * ((lam - centres) / widths) ** 2)).sum(axis=1)
    curves -= curves.mean(axis=1, keepdims=True)
    return curves / np.maximum(np.abs(curves).max(axis=1, keepdims=True), 1e-9)


def _base_spectrum(rng: np.random.Generator, bands: int) -> np.ndarray:
    """A positive, smooth reflectance-like spectrum around 1."""
    lam = np.linspace(0.0, 1.0, bands)
    return 1.0 + 0.3 * lam + 0.25 * _smooth_curves(rng, 1, bands, 4)[0]


def synth_hsi_cube(
    bands: int = 64, size: int = 64, classes: int = 6, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Make a synthetic hyperspectral scene and its class map.

    The scene is a warped Voronoi partition into ``3 * classes`` regions, each region assigned
    a class. Each class has a smooth spectral signature close to a shared base spectrum; each
    region adds its own small variation. The clean cube is blurred (mixed pixels at borders),
    scaled by a smooth illumination field and per-pixel brightness jitter, and gets strong
    per-pixel noise, so single spectra are ambiguous while a patch's neighbourhood is not.
    Pixels within half a pixel of a region border are unlabelled.

    Args:
        bands: spectral bands C.
        size: the scene is size x size pixels.
        classes: number of classes K (at least 2).
        seed: random seed; the same seed gives the same scene.

    Returns:
        ``(cube, labels)``: float32 (size, size, bands) and int64 (size, size) with -1 for
        unlabelled pixels and 0..K-1 for classes.

    Raises:
        DatasetError: an argument is out of range.
    """
    _check_positive(bands=bands, size=size, classes=classes)
    if classes < 2:
        raise DatasetError(f"classes must be >= 2, got {classes}")
    rng = np.random.default_rng([seed, 101])
    regions = 3 * classes
    seeds = rng.uniform(0, size, size=(regions, 2))
    region_class = rng.permutation(np.arange(regions) % classes)
    rr, cc = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    warp = [gaussian_filter(rng.normal(size=(size, size)), size / 8, mode="wrap") for _ in "rc"]
    warp = [w / max(np.abs(w).max(), 1e-9) * size / 10 for w in warp]
    pts = np.stack([rr + warp[0], cc + warp[1]], axis=-1)
    dist = np.linalg.norm(pts[:, :, None, :] - seeds[None, None], axis=-1)
    order = np.argsort(dist, axis=-1)
    region = order[..., 0]
    nearest = np.take_along_axis(dist, order[..., :2], axis=-1)
    labels = region_class[region].astype(np.int64)
    labels[(nearest[..., 1] - nearest[..., 0]) < 0.5] = -1

    base = _base_spectrum(rng, bands)
    class_sig = base + 0.12 * _smooth_curves(rng, classes, bands, 3)
    region_sig = class_sig[region_class] + 0.04 * _smooth_curves(rng, regions, bands, 3)
    clean = region_sig[region]  # (size, size, bands)
    clean = gaussian_filter(clean, sigma=(0.7, 0.7, 0), mode="reflect")
    light = gaussian_filter(rng.normal(size=(size, size)), size / 6, mode="wrap")
    light = 1.0 + 0.1 * light / max(light.std(), 1e-9)
    jitter = rng.lognormal(0.0, 0.05, size=(size, size))
    noise = 0.12 * rng.normal(size=(size, size, bands))
    cube = clean * (light * jitter)[..., None] + noise
    return cube.astype(np.float32), labels


def synth_hsi(
    out: str | os.PathLike[str],
    samples: int | None = None,
    bands: int = 64,
    size: int = 64,
    classes: int = 6,
    patch: int = 5,
    train_fraction: float = 0.1,
    seed: int = 0,
) -> DatasetMeta:
    """Write a synthetic hyperspectral patch dataset (see ``synth_hsi_cube``).

    Uses the same pipeline as ``prepare_hsi`` (``write_patch_dataset``): stratified random split,
    normalisation from training pixels, reflect padding, P x P patches.

    Args:
        out: the dataset file to write.
        samples: keep at most this many labelled pixels (stratified); None keeps all
            (about size * size minus the unlabelled borders).
        bands: spectral bands C.
        size: the scene is size x size pixels.
        classes: number of classes K.
        patch: odd patch side P.
        train_fraction: training fraction per class, in (0, 1).
        seed: random seed of the scene, the subsample and the split.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: an argument is out of range.
    """
    _check_positive(samples=samples, patch=patch)
    cube, labels = synth_hsi_cube(bands=bands, size=size, classes=classes, seed=seed)
    return write_patch_dataset(
        cube,
        labels,
        out,
        class_names=[f"class_{i}" for i in range(1, classes + 1)],
        patch=patch,
        train_fraction=train_fraction,
        split="random",
        seed=seed,
        max_samples=samples,
        source=f"synth hsi bands={bands} size={size} classes={classes} seed={seed}",
        extra_attrs={"synthetic": 1},
    )


class _SceneModel:
    """Per-class spectral signatures and textures of the synthetic scene images."""

    def __init__(self, bands: int, size: int, *, classes: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 202])
        self.bands, self.size, self.classes, self.seed = bands, size, classes, seed
        # Classes come in pairs sharing a spectral signature; within a pair the texture differs,
        # and every texture is shared by two classes with different signatures.
        n_spec = math.ceil(classes / 2)
        self.spec = np.arange(classes) % n_spec
        self.tex = (np.arange(classes) + np.arange(classes) // n_spec) % n_spec
        base = _base_spectrum(rng, bands)
        self.signature = base + _SPECTRAL * _smooth_curves(rng, n_spec, bands, 3)
        self.tex_load = 0.3 + 0.2 * np.abs(_smooth_curves(rng, n_spec, bands, 2))
        angles = np.pi * (np.arange(n_spec) + rng.uniform(0.2, 0.8, n_spec)) / n_spec
        self.angle = rng.permutation(angles)
        self.freq = rng.uniform(0.06, 0.22, n_spec)  # cycles per pixel
        self.blobby = np.arange(n_spec) % 2 == 1  # odd textures are isotropic blobs
        self.blob_scale = rng.uniform(1.5, 5.0, n_spec)  # pixels
        ky = np.fft.fftfreq(size)[:, None]
        kx = np.fft.fftfreq(size)[None, :]
        self.k2 = ky**2 + kx**2

    def texture(self, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Unit-variance textures (n, size, size) for texture ids ``t``, with random jitter."""
        n, s = t.size, self.size
        tex = np.empty((n, s, s))
        stripy = ~self.blobby[t]
        if stripy.any():
            m = int(stripy.sum())
            yy, xx = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
            angle = self.angle[t[stripy]] + rng.normal(0.0, _ANGLE_JITTER, m)
            freq = self.freq[t[stripy]] * rng.uniform(0.85, 1.15, m)
            phase = rng.uniform(0, 2 * np.pi, m)
            proj = xx * np.cos(angle)[:, None, None] + yy * np.sin(angle)[:, None, None]
            wave = np.cos(2 * np.pi * freq[:, None, None] * proj + phase[:, None, None])
            tex[stripy] = wave * np.sqrt(2)
        if (~stripy).any():
            m = int((~stripy).sum())
            scale = self.blob_scale[t[~stripy]] * rng.uniform(0.85, 1.15, m)
            lowpass = np.exp(-2 * (np.pi**2) * self.k2 * (scale**2)[:, None, None])
            blobs = np.real(np.fft.ifft2(np.fft.fft2(rng.normal(size=(m, s, s))) * lowpass))
            tex[~stripy] = blobs / (blobs.std(axis=(1, 2), keepdims=True) + 1e-9)
        return tex

    def block(self, y: np.ndarray, index: int) -> np.ndarray:
        """Images (n, bands, size, size) float32 for labels ``y``; block ``index`` seeds it."""
        rng = np.random.default_rng([self.seed, 303, index])
        n, s = y.size, self.size
        tex = self.texture(self.tex[y], rng)
        # A weaker texture of a random other class, so the dominant one has to be found.
        other = (self.tex[y] + rng.integers(1, self.tex.max() + 1, n)) % (self.tex.max() + 1)
        tex += rng.uniform(0.0, _DISTRACT, (n, 1, 1)) * self.texture(other, rng)
        sig = self.signature[self.spec[y]] * rng.uniform(0.75, 1.25, (n, 1))  # brightness
        load = self.tex_load[self.tex[y]] * rng.uniform(0.7, 1.3, (n, 1)) * _TEXTURE
        bg = np.real(
            np.fft.ifft2(np.fft.fft2(rng.normal(size=(n, s, s))) * np.exp(-self.k2 * 400.0))
        )
        bg /= bg.std(axis=(1, 2), keepdims=True) + 1e-9
        x = rng.standard_normal(size=(n, self.bands, s, s), dtype=np.float32)
        x *= _NOISE
        x += sig[:, :, None, None].astype(np.float32)
        x += load[:, :, None, None].astype(np.float32) * tex[:, None].astype(np.float32)
        x += (0.15 * bg[:, None]).astype(np.float32)
        return x


def synth_scenes(
    out: str | os.PathLike[str],
    samples: int = 2000,
    bands: int = 13,
    size: int = 64,
    classes: int = 10,
    train_fraction: float = 0.8,
    seed: int = 0,
) -> DatasetMeta:
    """Write synthetic EuroSAT-shaped multispectral scenes (N, bands, size, size).

    Classes come in pairs sharing a spectral signature and differ by texture (oriented stripes
    or isotropic blobs of a class-specific frequency/scale); each texture is shared by two
    classes with different signatures, so a model needs both. Images get random brightness,
    texture jitter, a smooth background and pixel noise. Generation is streamed in blocks and
    runs twice with the same seeds (``write_scenes``): once for the per-band mean/std of the
    training images, once to write normalised data.

    Args:
        out: the dataset file to write.
        samples: number of images N (balanced classes).
        bands: spectral bands C.
        size: image side in pixels.
        classes: number of classes K (at least 2).
        train_fraction: training fraction per class, in (0, 1).
        seed: random seed.

    Returns:
        The written dataset's metadata.

    Raises:
        DatasetError: an argument is out of range.
    """
    _check_positive(samples=samples, bands=bands, size=size, classes=classes)
    if classes < 2:
        raise DatasetError(f"classes must be >= 2, got {classes}")
    if samples < 2 * classes:
        raise DatasetError(f"samples must be >= 2 * classes = {2 * classes}, got {samples}")
    model = _SceneModel(bands, size, classes=classes, seed=seed)
    y = np.random.default_rng([seed, 404]).permutation(np.arange(samples) % classes)
    blocks: dict[int, np.ndarray] = {}  # the block being read (both passes go in order)

    def read(i: int) -> tuple[np.ndarray, int]:
        b = i // SCENE_BLOCK
        if b not in blocks:
            blocks.clear()
            blocks[b] = model.block(y[b * SCENE_BLOCK : (b + 1) * SCENE_BLOCK], b)
        return blocks[b][i % SCENE_BLOCK], int(y[i])

    names = [f"class_{i}" for i in range(1, classes + 1)]
    return write_scenes(
        out,
        read,
        samples,
        lambda labels: (names, *stratified_split(labels, train_fraction, seed, classes)),
        source=f"synth scenes bands={bands} size={size} classes={classes} seed={seed}",
        extra_attrs={"synthetic": 1, "train_fraction": float(train_fraction), "seed": seed},
        block=WRITE_BLOCK,
    )
