"""A hand-started server and worker: the run ends with the tables and the summary path."""

from __future__ import annotations

import socket
from pathlib import Path

from launch.report import setup_section
from tests.support.cluster import start_server, start_worker


def test_hand_started_server_ends_with_the_tables_and_the_summary_path(
    small_hsi: Path, tmp_path: Path
) -> None:
    quick = ("--epochs", "1", "--global-batch", "16", "--shutdown-timeout", "20")
    server, address = start_server(small_hsi, tmp_path, *quick)
    worker = start_worker(address, "w0")
    try:
        line = server.wait_for("summary: ", 120)
        assert server.wait() == 0 and worker.wait() == 0
        out = server.output()
    finally:
        server.kill()
        worker.kill()
    assert line.strip() == f"summary: {tmp_path / 'summary.json'}"
    data = {"settings": {}, "runs": [{"run_dir": str(tmp_path)}]}
    assert f"- workers' hosts: `{socket.gethostname()}`: w0" in setup_section(data)
    assert "mode " in out and "train s" in out and "worker " in out
    assert '"workers": [' not in out  # not the JSON summary
