"""Checkpoints: atomic files, the newest few kept, a damaged newest skipped on read, and a
live server that resumes from its run directory with the parameters it saved, bit for bit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from common.errors import ConfigError
from common.protocol.messages import StatusReply, StatusRequest
from pserver import checkpoint
from pserver.checkpoint import Checkpoint
from pserver.cli import main as pserver_main
from tests.support.cluster import events
from tests.support.live import clients, live_server, published


def made(version: int) -> Checkpoint:
    state = np.arange(6, dtype=np.float32) * version
    return Checkpoint(arrays={"state": state}, meta={"version": version, "note": "é"})


def test_a_checkpoint_reads_back_as_written(tmp_path: Path) -> None:
    path = checkpoint.write(tmp_path, made(7))
    assert path.name == "ckpt-0000000007.npz"
    back = checkpoint.read(path)
    assert back.version == 7 and back.meta["note"] == "é"
    assert back.meta["format"] == checkpoint.FORMAT
    assert np.array_equal(back.arrays["state"], made(7).arrays["state"])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file is left


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    for version in (3, 1, 12, 5, 9):
        checkpoint.write(tmp_path, made(version))
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [f"ckpt-{v:010d}.npz" for v in (5, 9, 12)][-checkpoint.KEEP :]
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-0000000012.npz"
    assert checkpoint.latest(tmp_path / "absent") is None


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint.write(tmp_path, made(4))
    newest = checkpoint.write(tmp_path, made(8))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        checkpoint.read(newest)
    with caplog.at_level(logging.WARNING, logger="pserver.checkpoint"):
        assert checkpoint.read_newest(tmp_path).version == 4
    assert any("trying the previous checkpoint" in r.message for r in caplog.records)
    (tmp_path / "ckpt-0000000004.npz").write_bytes(b"not a zip file")
    with pytest.raises(ConfigError, match="no readable checkpoint"):
        checkpoint.read_newest(tmp_path)


def test_a_file_of_an_unknown_format_is_refused(tmp_path: Path) -> None:
    document = np.frombuffer(b'{"format": 99, "version": 1}', dtype=np.uint8)
    path = tmp_path / "ckpt-0000000001.npz"
    np.savez(path, meta=document)
    with pytest.raises(ConfigError, match="unknown format"):
        checkpoint.read(path)


def test_only_temporary_files_of_interrupted_writes_are_removed(tmp_path: Path) -> None:
    kept = checkpoint.write(tmp_path, made(2))
    (tmp_path / ".ckpt-0000000003.npz.tmp").write_bytes(b"torn")
    (tmp_path / "notes.tmp").write_text("not ours")
    assert checkpoint.remove_stale_tmp(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, "notes.tmp"])


async def test_a_resumed_server_starts_from_the_saved_parameters(
    small_hsi: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    options = dict(mode="async", epochs=100, run_dir=tmp_path, checkpoint_every=1)
    async with live_server(small_hsi, **options) as ps, clients(ps.address, 1) as (c,):
        member, task = await c.join("w")
        for _ in range(2):
            gradient = rng.normal(0, 1e-3, ps.state_size).astype(np.float32)
            task = await c.push(member, task, gradient)
        saved = published(ps)
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files[-1] == "ckpt-0000000002.npz"
    on_disk = checkpoint.read_newest(tmp_path / "checkpoints")
    assert np.array_equal(on_disk.arrays["state"], saved.numpy())

    async with (
        live_server(small_hsi, **{**options, "resume": True}) as ps,
        clients(ps.address, 1) as (c,),
    ):
        status = await c.request(StatusRequest())
        assert isinstance(status, StatusReply) and status.status["version"] == 2
        assert torch.equal(published(ps), saved)
        counters = {"applied": 2, "rejected": 0, "staleness_sum": 0, "staleness_max": 0}
        assert ps.policy.state() == counters  # the policy's counters came back too
    start = next(e for e in events(tmp_path) if e["event"] == "start")
    assert start["plan"] == {"planner": "model", "spread": True, "min_batch": 1}  # as resolved
    resumed = [e for e in events(tmp_path) if e["event"] == "resume"]
    assert [e["version"] for e in resumed] == [2]


DAMAGES = {
    "parameters that are not finite": lambda c: c.arrays["state"].__setitem__(0, np.nan),
    "optimizer state that is not finite": lambda c: c.arrays["slots"].fill(np.inf),
    "a ledger of another size": lambda c: c.arrays.__setitem__("uses/1", np.zeros(3, np.int32)),
    "a cursor beyond the split": lambda c: c.meta["sampler"].__setitem__("cursor", 10**9),
    "no sampler books": lambda c: c.meta.pop("sampler"),
    "policy counters that are not numbers": lambda c: c.meta.__setitem__(
        "policy", {"applied": "x"}
    ),
    "worker history that is not a map": lambda c: c.meta.__setitem__("workers", [1, 2]),
    "a random state of another size": lambda c: c.arrays.__setitem__(
        "torch_rng", np.zeros(3, np.uint8)
    ),
}


async def test_a_checkpoint_with_damaged_contents_is_refused_on_resume(
    small_hsi: Path, tmp_path: Path
) -> None:
    """A well-formed file whose contents cannot be a run's is refused with a ConfigError:
    never resumed with parameters that are not finite or books of another size, never a
    crash with a raw exception."""
    options = dict(mode="async", optimizer="adam", epochs=100, run_dir=tmp_path, checkpoint_every=1)
    async with live_server(small_hsi, **options) as ps, clients(ps.address, 1) as (c,):
        member, task = await c.join("w")
        task = await c.push(member, task, np.full(ps.state_size, 1e-3, np.float32))
    folder = tmp_path / "checkpoints"
    (saved,) = [p for p in folder.iterdir() if p.name.endswith("1.npz")]
    good = saved.read_bytes()
    assert checkpoint.read(saved).arrays["slots"].size  # adam keeps optimizer state
    for name, damage in DAMAGES.items():
        for path in folder.iterdir():
            path.unlink()
        saved.write_bytes(good)
        damaged = checkpoint.read(saved)
        damage(damaged)
        saved.unlink()
        checkpoint.write(folder, damaged)
        with pytest.raises(ConfigError, match="the checkpoint is damaged"):
            async with live_server(small_hsi, **{**options, "resume": True}):
                pytest.fail(f"resumed from a checkpoint with {name}")


async def test_export_refuses_a_checkpoint_whose_parameters_are_not_finite(
    small_hsi: Path, tmp_path: Path
) -> None:
    """A model exported from such a checkpoint would answer NaN for every input."""
    options = dict(mode="async", epochs=100, run_dir=tmp_path, checkpoint_every=1)
    async with live_server(small_hsi, **options) as ps, clients(ps.address, 1) as (c,):
        member, task = await c.join("w")
        await c.push(member, task, np.full(ps.state_size, 1e-3, np.float32))
    saved = checkpoint.latest(tmp_path / "checkpoints")
    assert saved is not None
    args = ["export", str(tmp_path), "--dataset", str(small_hsi), "--format", "state-dict"]
    exported = CliRunner().invoke(pserver_main, [*args, "--out", str(tmp_path / "a.pt")])
    assert exported.exit_code == 0, exported.output  # the checkpoint as written exports
    damaged = checkpoint.read(saved)
    damaged.arrays["state"][3] = np.inf
    checkpoint.write(tmp_path / "checkpoints", damaged)
    refused = CliRunner().invoke(pserver_main, [*args, "--out", str(tmp_path / "b.pt")])
    assert refused.exit_code != 0 and "not finite" in refused.output, refused.output
    assert not (tmp_path / "b.pt").exists()
