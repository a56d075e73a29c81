"""CURVE with real processes: keys from ``pserver keygen``, an authorized worker and shards train
end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.procs import Child
from tests.support.cluster import events, start_server, start_shard, start_worker, summary


def _curve_worker(address: str, keys: dict[str, Path]) -> Child:
    """An authorized worker joining over CURVE."""
    curve = (
        "--curve-server-key",
        str(keys["server"]),
        "--curve-secret",
        str(keys["worker_secret"]),
    )
    return start_worker(address, "trusted", 1.0, *curve)


def test_keygen_cli_writes_key_pairs_and_authorizes_the_worker(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pserver.cli", "keygen", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for name in (
        "server.key",
        "server.key_secret",
        "worker.key",
        "worker.key_secret",
        "authorized_keys/worker.key",
    ):
        assert (tmp_path / "k" / name).is_file(), out
    assert (tmp_path / "k" / "server.key_secret").stat().st_mode & 0o077 == 0


def test_an_authorized_worker_trains_over_curve(
    small_hsi: Path, tmp_path: Path, curve_keys
) -> None:
    server, address = start_server(
        small_hsi,
        tmp_path / "run",
        "--epochs",
        "3",
        "--curve-secret",
        str(curve_keys["server_secret"]),
        "--authorized-keys",
        str(curve_keys["authorized_keys"]),
    )
    worker = _curve_worker(address, curve_keys)
    try:
        assert server.wait() == 0 and worker.wait() == 0
    finally:
        server.kill()
        worker.kill()
    result = summary(tmp_path / "run")
    assert result["epochs"] == 3 and result["workers"][0]["samples"] > 0


def test_shards_register_and_train_over_curve(small_hsi: Path, tmp_path: Path, curve_keys) -> None:
    """Set up as docs/operations.md says: shards take the server's two CURVE options and
    prove a secret derived from the server key; nothing else is needed."""
    curve = ("--curve-secret", str(curve_keys["server_secret"]))
    curve += ("--authorized-keys", str(curve_keys["authorized_keys"]))
    run_dir = tmp_path / "run"
    server, address = start_server(
        small_hsi, run_dir, "--epochs", "1", "--shards", "2", "--chunk-mb", "0.05", *curve
    )
    shards = [start_shard(address, f"shard{i}", *curve) for i in range(2)]
    worker = _curve_worker(address, curve_keys)
    try:
        assert server.wait(90) == 0, server.tail(30)
        assert worker.wait(30) == 0 and all(s.wait(30) == 0 for s in shards)
    finally:
        for proc in (server, worker, *shards):
            proc.kill()
    registered = [e for e in events(run_dir) if e["event"] == "shard"]
    assert sorted(e["index"] for e in registered) == [0, 1]
    result = summary(run_dir)
    assert result["details"]["shards"] == 2 and result["epochs"] == 1
