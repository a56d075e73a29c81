"""Batch augmentation: reproducible per key, dihedral on every sample, spectral noise, options."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from worker.augment import DIHEDRAL, Augmenter, dihedral
from worker.config import WorkerConfig


def _batch(n: int = 32, c: int = 3, h: int = 8, w: int = 8, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, c, h, w), generator=gen)


def _matching_codes(x: torch.Tensor, out: torch.Tensor) -> list[set[int]]:
    """Per sample, the dihedral codes that map x[i] exactly onto out[i]."""
    square = x.shape[-1] == x.shape[-2]
    codes = [d for d in DIHEDRAL if square or d % 2 == 0]
    pairs = zip(x, out, strict=True)
    return [{d for d in codes if torch.equal(dihedral(xi, d), oi)} for xi, oi in pairs]


def test_the_eight_codes_are_the_distinct_symmetries_of_a_square() -> None:
    x = torch.arange(16.0).reshape(1, 4, 4)
    images = {tuple(dihedral(x, d).flatten().tolist()) for d in DIHEDRAL}
    assert len(images) == 8
    assert torch.equal(dihedral(x, 2), x.flip(-1).flip(-2))  # half turn = both flips
    assert torch.equal(dihedral(x, 6), x.flip(-2))  # flip then half turn = vertical flip
    with pytest.raises(ValueError, match=r"0\.\.7"):
        dihedral(x, 8)


def test_same_key_same_augmentation_and_different_keys_differ() -> None:
    x = _batch(64)
    aug = Augmenter(seed=7, noise=0.1)
    first = aug(x, step_key=12)
    assert torch.equal(first, aug(x, step_key=12))
    assert torch.equal(first, Augmenter(seed=7, noise=0.1)(x.clone(), step_key=12))
    assert not torch.equal(first, aug(x, step_key=13))
    assert not torch.equal(first, Augmenter(seed=8, noise=0.1)(x, step_key=12))


def test_every_sample_is_a_dihedral_transform_and_keeps_its_values() -> None:
    x = _batch(64)
    before = x.clone()
    out = Augmenter(seed=0)(x, step_key=3)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "cpu"
    assert torch.equal(x, before), "the input batch must not be modified"
    assert torch.equal(out.flatten(1).sort(dim=1).values, x.flatten(1).sort(dim=1).values), (
        "the set of values of each sample must be preserved"
    )
    matches = _matching_codes(x, out)
    assert all(matches), "each output sample must be a dihedral transform of its input"
    used = set().union(*matches)
    assert len(used) > 4, f"64 samples should use most of the 8 transforms, got {used}"


def test_all_transforms_are_drawn_and_labels_are_untouched() -> None:
    x = _batch(256, c=1, h=4, w=4)
    y = torch.randint(0, 10, (256,))
    y_before = y.clone()
    codes, offsets = Augmenter(seed=1).draw(x.shape, step_key=0)
    assert offsets is None
    counts = torch.bincount(codes, minlength=8)
    assert (counts > 10).all(), f"transforms should be drawn uniformly, got {counts.tolist()}"
    out = Augmenter(seed=1)(x, step_key=0)
    assert all(_matching_codes(x, out))
    assert torch.equal(y, y_before)


def test_subgroups_follow_the_options_and_the_shape() -> None:
    wide = _batch(64, h=4, w=6)
    for flips, rotations, allowed in (
        (True, True, {0, 2, 4, 6}),  # no quarter turns on a 4 x 6 image
        (True, False, {0, 2, 4, 6}),
        (False, True, {0, 2}),
        (False, False, {0}),
    ):
        aug = Augmenter(seed=0, flips=flips, rotations=rotations)
        assert set(aug.codes_allowed(4, 6)) == allowed
        out = aug(wide, step_key=5)
        assert out.shape == wide.shape
        assert all(m & allowed for m in _matching_codes(wide, out))
    assert set(Augmenter(0, flips=False).codes_allowed(5, 5)) == {0, 1, 2, 3}
    assert set(Augmenter(0).codes_allowed(5, 5)) == set(DIHEDRAL)
    x = _batch(4)
    assert Augmenter(0, flips=False, rotations=False)(x, 1) is x


def test_spectral_noise_is_one_offset_per_sample_and_band() -> None:
    x = _batch(512, c=4, h=6, w=6)
    aug = Augmenter(seed=3, noise=0.2)
    out = aug(x, step_key=9)
    codes, offsets = aug.draw(x.shape, step_key=9)
    assert offsets is not None and offsets.shape == (512, 4, 1, 1)
    clean = torch.stack([dihedral(xi, int(d)) for xi, d in zip(x, codes, strict=True)])
    diff = out - clean
    assert torch.allclose(diff, offsets.expand_as(diff), atol=1e-6)
    assert diff.amax(dim=(2, 3)).sub(diff.amin(dim=(2, 3))).abs().max() < 1e-5
    assert 0.18 < float(offsets.std()) < 0.22
    assert abs(float(offsets.mean())) < 0.03


def test_bad_input_and_options_are_refused() -> None:
    with pytest.raises(ValueError, match="float tensor"):
        Augmenter(0)(torch.zeros(2, 3, 4), step_key=0)
    with pytest.raises(ValueError, match="float tensor"):
        Augmenter(0)(torch.zeros(2, 1, 4, 4, dtype=torch.int64), step_key=0)
    assert Augmenter(0)(torch.zeros(0, 1, 4, 4), step_key=0).shape == (0, 1, 4, 4)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="noise"):
            Augmenter(0, noise=bad)


def test_worker_config_checks_the_augmentation_options() -> None:
    base = {"server": "tcp://127.0.0.1:5555"}
    assert WorkerConfig(**base, augment=True, augment_noise=0.05).validate().augment
    with pytest.raises(ConfigError, match=r"--augment-noise must be >= 0, got -1"):
        WorkerConfig(**base, augment=True, augment_noise=-1.0).validate()
    with pytest.raises(ConfigError, match=r"--augment-noise 0.1 has no effect without"):
        WorkerConfig(**base, augment_noise=0.1).validate()
