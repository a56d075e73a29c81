"""Parameter shards as separate processes: training to accuracy, a shard killed mid-run, resume,
and the 16-bit wire formats' accuracy cost."""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

import pytest

from common.procs import Child
from tests.support.cluster import events, start_server, start_shard, start_worker, summary

TRAIN = ("--lr", "0.05", "--lr-schedule", "cosine", "--chunk-mb", "0.1")


def _cluster(
    dataset: Path, run_dir: Path, shards: int, slowdowns: tuple[float, ...], *options: str
) -> tuple[Child, list[Child], list[Child]]:
    server, address = start_server(
        dataset, run_dir, "--shards", str(shards), "--workers", str(len(slowdowns)), *options
    )
    shard_procs = [start_shard(address, f"shard{i}") for i in range(shards)]
    workers = [start_worker(address, f"w{i}", s) for i, s in enumerate(slowdowns)]
    return server, shard_procs, workers


def _finish(procs: list[Child]) -> None:
    for proc in procs:
        proc.kill()


def _check_epochs(run_dir: Path, epochs: int, train_count: int) -> None:
    """Every epoch completed, each sample once (an epoch redone after a resume counts again)."""
    done = [e for e in events(run_dir) if e["event"] == "epoch"]
    numbers = [e["epoch"] for e in done]
    assert set(numbers) == set(range(1, epochs + 1)) and numbers[-1] == epochs
    assert all(e["exactly_once"] and e["samples"] == train_count for e in done)


def test_async_with_two_shards_trains_jasper_ridge(jasper_h5: Path, tmp_path: Path) -> None:
    server, shards, workers = _cluster(
        jasper_h5, tmp_path, 2, (1.0, 2.0), "--mode", "async", "--epochs", "8", *TRAIN
    )
    try:
        assert server.wait() == 0
        assert [w.wait() for w in workers] == [0, 0]
        assert all(s.wait(timeout=30) == 0 for s in shards)
    finally:
        _finish([server, *shards, *workers])
    result = summary(tmp_path)
    assert result["details"]["shards"] == 2
    assert result["final"]["oa"] >= 0.85, result["final"]
    _check_epochs(tmp_path, 8, 964)


@pytest.mark.exclusive  # asserts how long the failure took
def test_a_killed_shard_ends_the_run_naming_it_and_a_resume_finishes(
    jasper_h5: Path, tmp_path: Path
) -> None:
    args = (
        "--mode", "weighted-sync", "--epochs", "6", "--checkpoint-every", "20",
        "--shard-timeout", "3", "--heartbeat", "0.5", "--dead-after", "3", *TRAIN,
    )  # fmt: skip
    server, shards, workers = _cluster(jasper_h5, tmp_path, 2, (1.0, 2.0), *args)
    try:
        line = server.wait_for("checkpoint of version")
        saved = int(line.split("checkpoint of version", 1)[1].split()[0])
        server.wait_for("epoch 2 done")
        victim = shards[1].expect("serves state").split(" at ")[-1].strip()
        shards[1].popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert server.wait(timeout=60) != 0
        took = time.monotonic() - killed
        log = server.output()
        assert f"at {victim} (state [" in log and "did not answer" in log, log
        assert "Traceback" not in log
        for worker in workers:  # told the run failed
            assert worker.wait(timeout=60) != 0
            line = worker.expect("Error: ")
            assert line.startswith("Error: the server stopped the run: shard ")
            assert f" at {victim} (state [" in line
        assert shards[0].wait(timeout=30) == 0
    finally:
        _finish([server, *shards, *workers])
    assert took < 30
    server, shards, workers = _cluster(jasper_h5, tmp_path, 2, (1.0, 2.0), *args, "--resume")
    try:
        line = server.expect("resumed at version")
        assert int(line.split("resumed at version", 1)[1].split()[0]) >= saved
        assert server.wait() == 0 and [w.wait() for w in workers] == [0, 0]
    finally:
        _finish([server, *shards, *workers])
    result = summary(tmp_path)
    assert result["epochs"] == 6 and result["final"]["oa"] >= 0.85
    _check_epochs(tmp_path, 6, 964)


@pytest.mark.exclusive  # --shard-timeout 2 against compute time
def test_workers_exit_non_zero_naming_the_shard_loss_that_stopped_the_run(
    small_hsi: Path, tmp_path: Path
) -> None:
    args = ("--mode", "async", "--epochs", "200", "--shard-timeout", "2", "--heartbeat", "0.5")
    server, shards, workers = _cluster(small_hsi, tmp_path, 2, (1.0,), *args, "--dead-after", "3")
    try:
        for _ in workers:
            server.wait_for("joined")
        victim = shards[1].expect("serves state").split(" at ")[-1].strip()
        shards[1].popen.send_signal(signal.SIGKILL)
        assert server.wait(timeout=60) != 0
        for worker in workers:
            assert worker.wait(timeout=60) != 0
            line = worker.expect("Error: ")
            assert line.startswith("Error: the server stopped the run: shard ")
            assert f" at {victim} (state [" in line and "did not answer" in line
            assert "Traceback" not in worker.output()
        assert shards[0].wait(timeout=30) == 0
    finally:
        _finish([server, *shards, *workers])


def _final_oa(dataset: Path, run_dir: Path, wire: str, seed: int) -> float:
    server, address = start_server(
        dataset, run_dir, "--mode", "weighted-sync", "--workers", "2", "--epochs", "6",
        "--seed", str(seed), "--wire-dtype", wire, "--eval-every", "0", *TRAIN,
    )  # fmt: skip
    workers = [start_worker(address, f"w{i}", s) for i, s in enumerate((1.0, 2.0))]
    try:
        assert server.wait() == 0 and [w.wait() for w in workers] == [0, 0]
    finally:
        _finish([server, *workers])
    return float(summary(run_dir)["final"]["oa"])


@pytest.mark.exclusive  # weighted-sync shares follow speeds
def test_bf16_on_the_wire_costs_less_than_a_point_of_accuracy(
    jasper_h5: Path, tmp_path: Path
) -> None:
    """Final accuracy (the one evaluation, at the end) compared with fixed seeds, the median of
    three runs each."""
    oa = {
        wire: statistics.median(
            _final_oa(jasper_h5, tmp_path / f"{wire}-{seed}", wire, seed) for seed in (0, 1, 2)
        )
        for wire in ("fp32", "bf16")
    }
    print(f"median final OA over seeds 0, 1, 2: {oa}")
    assert oa["fp32"] >= 0.85
    assert abs(oa["bf16"] - oa["fp32"]) <= 0.01, oa
