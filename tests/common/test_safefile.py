"""Files written safely: planted links and FIFOs at temporary names, and writes that never
return."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from common.safefile import WriteThread, WriteTimeout, open_temporary, run_bounded, write_atomic


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "summary.json"
    (tmp_path / ".summary.json.tmp").symlink_to(victim)
    write_atomic(target, lambda handle: handle.write(b"new"))
    assert victim.read_text() == "keep" and target.read_text() == "new"
    assert not target.is_symlink() and not (tmp_path / ".summary.json.tmp").exists()


def test_a_fifo_at_the_temporary_name_does_not_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ".ckpt.npz.tmp")
    done = threading.Event()

    def write() -> None:
        write_atomic(tmp_path / "ckpt.npz", lambda handle: handle.write(b"x"), sync=True)
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(10), "the write blocked on the FIFO"
    assert (tmp_path / "ckpt.npz").read_bytes() == b"x"


def test_the_temporary_file_is_always_new(tmp_path: Path) -> None:
    path = tmp_path / "t.tmp"
    path.write_bytes(b"old content that is longer")
    with open_temporary(path) as handle:
        handle.write(b"new")
    assert path.read_bytes() == b"new"


async def test_a_write_that_never_returns_is_abandoned_in_time() -> None:
    release = threading.Event()
    loop = asyncio.get_running_loop()
    begin = loop.time()
    with pytest.raises(WriteTimeout, match=r"did not finish within 0\.5 s"):
        await run_bounded(lambda: release.wait(30), 0.5, "the test write")
    assert loop.time() - begin < 3
    assert await run_bounded(lambda: 7, 5, "a quick write") == 7
    with pytest.raises(OSError, match="full"):
        await run_bounded(lambda: (_ for _ in ()).throw(OSError("disk full")), 5, "a failing one")
    release.set()


def test_a_stuck_write_thread_is_abandoned_on_close() -> None:
    release = threading.Event()
    thread = WriteThread("test")
    thread.submit(lambda: release.wait(30))
    assert thread.close(0.2) is False
    release.set()
    done = WriteThread("test")
    assert done.submit(lambda: 3).result(5) == 3 and done.close(5) is True
