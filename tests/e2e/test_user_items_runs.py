"""What a worker of a real run prints last: an interrupted server told from a finished run."""

from __future__ import annotations

import json
from pathlib import Path


def _last_line(proc) -> str:
    return [line for line in proc.lines if line.strip()][-1].strip()


def test_a_worker_last_line_tells_an_interrupted_server_from_a_finished_run(
    small_hsi: Path, tmp_path: Path
) -> None:
    import signal

    from tests.support.cluster import start_server, start_worker

    interrupted, address = start_server(
        small_hsi, tmp_path / "stopped", "--mode", "async", "--workers", "2", "--epochs", "1000"
    )
    stopped = [start_worker(address, "a"), start_worker(address, "b", 2.0)]
    finished, address = start_server(
        small_hsi, tmp_path / "finished", "--mode", "async", "--workers", "1", "--epochs", "1"
    )
    done = start_worker(address, "c")
    try:
        interrupted.wait_for("epoch 1 done")
        interrupted.popen.send_signal(signal.SIGINT)  # Ctrl-C
        assert interrupted.wait(timeout=30) == 128 + signal.SIGINT
        assert finished.wait(timeout=60) == 0
        assert [w.wait(timeout=30) for w in (*stopped, done)] == [0, 0, 0]
    finally:
        for proc in (interrupted, finished, *stopped, done):
            proc.kill()
    for worker in stopped:
        line = _last_line(worker)
        assert line.startswith(
            f"worker {worker.name}: server interrupted (Ctrl-C or SIGTERM) after "
        )
        assert "run finished" not in worker.output()
    steps = json.loads((tmp_path / "finished" / "summary.json").read_text())["steps"]
    assert _last_line(done).startswith(
        f"worker c: run finished (all epochs done) after {steps} steps, "
    )


def test_ctrl_c_on_a_server_still_waiting_for_workers_says_no_checkpoint_was_written(
    small_hsi: Path, tmp_path: Path
) -> None:
    import signal

    from tests.support.cluster import start_server

    server, _ = start_server(small_hsi, tmp_path, "--workers", "2", "--epochs", "1")
    try:
        server.popen.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        server.kill()
    server.expect("pserver: interrupted; no update was applied, so no checkpoint; summary written")
    assert "checkpoint and summary written" not in server.output()
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "summary.json").is_file()
