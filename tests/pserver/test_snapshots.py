"""Snapshots every N updates, scored after training: files, agreement, damage, first to target."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.errors import ConfigError
from pserver.config import ServerConfig
from pserver.snapshots import snapshots as snap
from tests.support.requirements import missing

INFO = {"model": "m", "dataset": "d.h5", "fingerprint": "f", "state_size": 10, "mode": "async"}


def test_writer_bounds_disk_by_doubling_the_interval(tmp_path: Path) -> None:
    writer = snap.SnapshotWriter(tmp_path, every=1, limit=4, info=INFO)
    state = np.arange(10, dtype=np.float32)
    released: list[int] = []

    async def run() -> None:
        for version in range(1, 41):
            if not writer.due(version):
                continue

            async def fetch(v: int = version) -> tuple[int, np.ndarray, Any]:
                return v, state + v, lambda: released.append(v)

            await writer.take(snap.SnapshotMeta(version, 1, version * 8, version / 10), fetch)
        await writer.drain()

    asyncio.run(run())
    writer.close()
    versions = [v for v, _ in snap.list_snapshots(tmp_path / "snapshots")]
    assert writer.every == 16 and versions == [16, 32]
    assert len(released) == writer.written  # every held state was let go
    assert snap.read_run_file(tmp_path / "snapshots")["every"] == 16
    meta, saved = snap.read(tmp_path / "snapshots" / "snap-0000000032.npz", 10)
    np.testing.assert_array_equal(saved, state + 32)
    assert meta.samples == 256 and meta.train_time_s == pytest.approx(3.2)


def test_snapshots_need_a_run_dir(small_hsi: Path) -> None:
    with pytest.raises(ConfigError, match="--snapshot-every-updates needs --run-dir"):
        ServerConfig(dataset=small_hsi, model="hsi-cnn", epochs=1, snapshot_every_updates=5)
    with pytest.raises(ConfigError, match="--snapshot-every-updates must be >= 1"):
        ServerConfig(
            dataset=small_hsi,
            model="hsi-cnn",
            epochs=1,
            snapshot_every_updates=0,
            run_dir=Path("x"),
        )


def test_a_resumed_run_drops_snapshots_of_redone_versions(tmp_path: Path) -> None:
    first = snap.SnapshotWriter(tmp_path, every=2, limit=100, info=INFO)
    state = np.zeros(10, dtype=np.float32)
    for version in (2, 4, 6, 8):
        first.submit(snap.SnapshotMeta(version, 1, version, float(version)), state)
    first.close()
    resumed = snap.SnapshotWriter(tmp_path, every=2, limit=100, info=INFO, resumed_at=5)
    resumed.close()
    assert [v for v, _ in snap.list_snapshots(tmp_path / "snapshots")] == [2, 4]
    assert resumed.due(6) and not resumed.due(4)


def test_ddp_and_compare_refuse_a_bad_interval(small_hsi: Path, tmp_path: Path) -> None:
    from launch.compare import CompareConfig
    from launch.ddp.launcher import DDPConfig
    from launch.settings import TrainSettings

    train = TrainSettings(epochs=1)
    ddp = DDPConfig(small_hsi, "hsi-cnn", (1.0,), tmp_path, train, snapshot_every_steps=0)
    with pytest.raises(ConfigError, match="--snapshot-every-steps must be >= 1, got 0"):
        ddp.validate()
    compare = CompareConfig(
        small_hsi, "hsi-cnn", ("async",), (1.0, 1.0), tmp_path, train, snapshot_every=-1
    )
    with pytest.raises(ConfigError, match="--snapshot-every must be >= 1, got -1"):
        compare.validate()
    compare = CompareConfig(
        small_hsi, "hsi-cnn", ("async",), (1.0, 1.0, 1.0), tmp_path, train, snapshot_every=5
    )
    options = compare.cluster("async", tmp_path).server_options
    assert options[options.index("--snapshot-every-updates") + 1] == "15"
    assert compare.ddp("ddp", tmp_path).snapshot_every_steps == 5


# --- writes that never return ----------------------------------------------------------------


async def test_a_stuck_write_is_abandoned_and_the_server_still_ends_in_time(
    small_hsi: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write that never returns (a stalled file system, which cannot be made here: the
    write functions block instead) costs --write-timeout, and the end of the run stays
    within --shutdown-timeout, saying what was abandoned."""
    import threading

    from pserver import checkpoint
    from tests.support.live import live_server

    stalled = threading.Event()

    def stuck(*args: Any, **kwargs: Any) -> Any:
        stalled.wait(60)
        raise OSError("released by the test")

    monkeypatch.setattr(checkpoint, "write", stuck)
    monkeypatch.setattr(snap, "write", stuck)
    run_dir = tmp_path / "run"
    options = dict(run_dir=run_dir, write_timeout_s=1.0, shutdown_timeout_s=6.0)
    try:
        async with live_server(small_hsi, snapshot_every_updates=1, **options) as ps:
            begin = asyncio.get_running_loop().time()
            assert not await asyncio.wait_for(ps.checkpointer.save(), 10)
            assert asyncio.get_running_loop().time() - begin < 5
            failed = [e for e in ps.log.events if e["event"] == "checkpoint_failed"]
            assert "did not finish within 1 s" in failed[0]["error"]
            ps.snapshots.writer.submit(snap.SnapshotMeta(1, 0, 0, 0.0), np.zeros(4, np.float32))
            begin = asyncio.get_running_loop().time()
            ps.request_stop()
            await asyncio.wait_for(ps.done.wait(), 10)
            assert asyncio.get_running_loop().time() - begin < 6.0 + 1.0
        abandoned = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
        assert any("snapshot writes still running" in m for m in abandoned), abandoned
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 0
    finally:
        stalled.set()


@pytest.fixture
def tiny_disk(tmp_path: Path, pytestconfig: pytest.Config) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test (root only), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        missing(pytestconfig, "tmpfs", f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_snapshots_leave_the_room_a_checkpoint_needs(tiny_disk: Path) -> None:
    """Snapshots of 256 KiB on a 4 MiB disk, never thinned: they stop while a checkpoint of
    the state (and two optimizer slots) still fits, and that checkpoint is then written."""
    writer = snap.SnapshotWriter(tiny_disk, every=1, limit=1000, info=INFO)
    state = np.ones(1 << 16, dtype=np.float32)
    for version in range(1, 31):
        writer.submit(snap.SnapshotMeta(version, 1, version * 8, version / 10), state).result()
    writer.close()
    assert 0 < writer.written < 30 and writer.failed == 30 - writer.written
    checkpoint = np.ones(3 * state.size + (1 << 18), dtype=np.float32)  # + 1 MiB of metadata
    np.save(tiny_disk / "checkpoint.npy", checkpoint)
    assert (tiny_disk / "checkpoint.npy").stat().st_size > checkpoint.nbytes
