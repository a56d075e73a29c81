"""The process layer: bounded polling, children that are always reaped with their process
groups, and process facts (psutil, getrusage)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from common.errors import WaitTimeout
from common.polling import poll_until
from common.procs import Child, ChildError, Children, is_running
from tests.support.live import poll_until_async
from tests.support.paths import ROOT

PY = sys.executable


def _script(code: str) -> list[str]:
    return [PY, "-u", "-c", code]


def test_poll_until_returns_the_first_truthy_result() -> None:
    calls = iter([None, 0, "", "found", "later"])
    assert poll_until(lambda: next(calls), 5, 0.001) == "found"


def test_poll_until_gives_up_at_the_timeout_and_lets_the_predicate_fail_early() -> None:
    begin = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"after 0\.3 s waiting for the flag"):
        poll_until(lambda: False, 0.3, 0.05, "the flag")
    assert 0.3 <= time.monotonic() - begin < 2.0

    def broken() -> bool:
        raise ValueError("gone")

    with pytest.raises(ValueError, match="gone"):
        poll_until(broken, 5)


async def test_poll_until_async_lets_the_loop_run() -> None:
    import asyncio

    flag: list[int] = []
    asyncio.get_running_loop().call_later(0.05, flag.append, 7)
    assert await poll_until_async(lambda: flag and flag[0], 5) == 7
    with pytest.raises(WaitTimeout):
        await poll_until_async(lambda: None, 0.1)


def test_a_child_is_followed_line_by_line(tmp_path: Path) -> None:
    code = "import time\nfor word in ('one', 'two', 'one again'): print(word); time.sleep(0.05)"
    log = tmp_path / "child.log"
    child = Child("words", _script(code), log_path=log)
    try:
        assert child.wait_for("one", 30) == "one\n"
        assert child.wait_for("one", 30) == "one again\n"  # after the line returned before
        assert child.expect("two", 30) == "two\n"  # lines already read count
        assert child.wait_for_match(r"^(\w+) again$", 30).group(1) == "one"
        assert child.wait(30) == 0
    finally:
        child.kill()
    assert child.output() == "one\ntwo\none again\n"
    assert log.read_text() == child.output()
    assert child.tail(1) == "    [words] one again"


def test_waits_on_a_child_are_bounded() -> None:
    child = Child(
        "quiet", _script("import sys, time; print('x'); sys.stdout.flush(); time.sleep(60)")
    )
    try:
        with pytest.raises(ChildError, match=r"quiet printed no 'never' within 0\.3 s"):
            child.wait_for("never", 0.3)
        with pytest.raises(ChildError, match=r"quiet did not exit within 0\.2 s"):
            child.wait(0.2)
    finally:
        child.kill()
    assert child.code == -signal.SIGKILL
    ended = Child("ended", _script("print('bye'); raise SystemExit(3)"))
    with pytest.raises(ChildError, match=r"ended ended before printing 'never'\n.*\[ended\] bye"):
        ended.wait_for("never", 30)
    assert ended.wait(30) == 3
    assert ended.failure() == "ended exited with code 3: bye"


def test_stop_kills_what_ignores_sigterm_with_its_whole_group(tmp_path: Path) -> None:
    """The child ignores SIGTERM and has started a grandchild in its group: after the grace
    period both are killed, and the child is reaped."""
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "grand = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(grand.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = Child("stubborn", _script(code))
    grandchild = int(child.wait_for_match(r"^(\d+)$", 30).group(1))
    begin = time.monotonic()
    child.stop(grace=0.5)
    assert time.monotonic() - begin < 10
    assert child.code == -signal.SIGKILL
    poll_until(lambda: not is_running(grandchild), 10, 0.05, "the grandchild to die")


def test_children_stop_the_first_one_first_then_the_rest() -> None:
    """The server is asked to stop and given its grace period before the worker is asked."""
    sink = io.StringIO()
    stopper = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    print('stopping', flush=True)\n"
        "    time.sleep(0.5)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )

    def failing_check() -> None:
        raise RuntimeError("check")

    with Children(sink) as children:
        server = children.start("server", _script(stopper))
        worker = children.start("worker", _script(stopper))
        server.wait_for("up", 30)
        worker.wait_for("up", 30)
        with pytest.raises(ChildError, match=r"server did not finish within 0\.2 s"):
            children.wait(server, 0.2)
        with pytest.raises(RuntimeError, match="check"):
            children.wait(server, 30, check=failing_check)
        children.stop(server, first_grace_s=30, grace_s=30)
        assert server.code == 0 and worker.code == 0
    log = sink.getvalue()
    assert log.index("[server] stopping\n") < log.index("[worker] stopping\n"), log


def test_is_running_sees_exit_before_the_child_is_reaped() -> None:
    proc = subprocess.Popen([PY, "-c", "pass"])
    try:
        # not reaped yet: a zombie, which does not count as running
        poll_until(lambda: not is_running(proc.pid), 30, 0.05, "the child to exit")
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        proc.wait(timeout=30)
    assert not is_running(proc.pid)


def test_peak_rss_keeps_the_largest_size_this_program_reached() -> None:
    code = (
        "from common.procs import peak_rss_bytes\n"
        "before = peak_rss_bytes()\n"
        "x = bytearray(200 * 2**20); x[::4096] = b'1' * len(x[::4096])\n"
        "del x\n"
        "print(before, peak_rss_bytes())\n"
    )
    done = subprocess.run(
        [PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    before, after = map(int, done.stdout.split())
    assert 0 < before < 200 * 2**20 <= after  # every page of 200 MiB touched, then freed


def test_a_small_program_started_by_a_large_one_reports_its_own_peak() -> None:
    code = (
        "import subprocess, sys\n"
        "x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096])\n"
        "child = 'from common.procs import peak_rss_bytes; print(peak_rss_bytes())'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True,"
        " check=True, timeout=60).stdout.strip())\n"
    )
    done = subprocess.run(
        [PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert int(done.stdout) < 200 * 2**20  # not the parent's 300 MiB
