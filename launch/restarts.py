"""A local cluster's supervision: the server, its shards and the workers are watched while the
run goes, and what dies is started again, as torchrun's ``--max-restarts`` does.

A process that exits abnormally (killed, crashed, failed) is restarted; a clean end (0) or a
stop asked for (Ctrl-C or SIGTERM: 130, 143, or killed by either) is not. A dead server, or a
dead shard (the server is then killed: its state is incomplete), restarts the server with
``--resume`` from its newest checkpoint, on the same address (so the workers rejoin it), with
new shards; with no checkpoint yet it starts the run again (``--overwrite``). A worker that
dies after joining is started again with the same command and rejoins. The server may be
restarted ``restarts`` times in all and each worker as often; past that a dead server ends the
launch with its error and a dead worker stays dead (the run goes on without it). A worker
taken out on purpose (its node leaves, ``leave``) is neither a failure nor restarted until
it is brought back. Once the server has ended, a worker still waiting to join it (started or
brought back late) is stopped at once: no server will answer it.
"""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from common.errors import PSError
from common.procs import Child, Children
from common.rundir import UPDATES
from launch.procs import EventsMark, joined_names, new_events, wait_for_address
from pserver.checkpoint import latest

log = logging.getLogger(__name__)

STOPPED = frozenset({0, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM})


def restart_due(code: int | None) -> bool:
    """Whether a process that exited with ``code`` (None: still running) is started again."""
    return code is not None and code not in STOPPED


class Supervisor:
    """Starts a cluster's server, shards and workers, and restarts what dies.

    Args:
        children: starts and stops the processes.
        run_dir: the server's run directory (its ``metrics.jsonl`` and checkpoints).
        restarts: restarts allowed for the server, and for each worker.
        server_argv: the server's command line with extra options (``--bind`` must come from
            it: a restart passes ``--bind ADDRESS`` to keep the address).
        shard_argvs: (name, command line) of each shard for a server address.
        startup_timeout_s: how long a server may take to write its ``start`` event.
        marks: where each server's events begin: the first server's (taken by the caller
            before anything started); the supervisor appends one per restart. The caller
            closes them.
        set_budget: rewrites worker ``index``'s CPU quota (``Nodes.set_budget``), for the
            nodes' schedules (``launch.cluster.schedule.NodeActions``, with ``leave`` and
            ``rejoin``).
    """

    def __init__(
        self,
        *,
        children: Children,
        run_dir: Path,
        restarts: int,
        server_argv: Callable[[Sequence[str]], list[str]],
        shard_argvs: Callable[[str], list[tuple[str, list[str]]]],
        startup_timeout_s: float,
        marks: list[EventsMark],
        set_budget: Callable[[int, float], None],
    ) -> None:
        self.children, self.run_dir, self.restarts = children, run_dir, restarts
        self.server_argv, self.shard_argvs = server_argv, shard_argvs
        self.startup_timeout_s, self.marks = startup_timeout_s, marks
        self.set_budget = set_budget
        self.metrics = run_dir / "metrics.jsonl"
        self.server: Child | None = None
        self.shards: list[Child] = []
        self.workers: list[Child] = []
        self.commands: list[tuple[str, list[str]]] = []
        self.address = ""
        self.joined: set[str] = set()  # workers known to have joined
        self.server_restarts = 0
        self.worker_restarts: list[int] = []
        self.versions_replayed = 0
        self.away: set[int] = set()  # workers taken out on purpose (their node left)
        self.joins_at_start: list[int] = []  # each worker's join events when it last started
        self.tick: Callable[[], None] | None = None  # called at every check while waiting

    def start_server(self, extra: Sequence[str] = ()) -> str:
        """Start the server (with ``extra`` options) and, once it listens, its shards; a server
        killed by a signal before it listens is started again (a restart, if one is left).

        Returns:
            The address it listens on.

        Raises:
            PSError: it exited before it listened (killed: with no restart left).
            NetworkTimeout: it did not listen within the start-up timeout.
        """
        while True:
            if self.server is not None:  # a restart: its events begin here
                self.marks.append(EventsMark(self.metrics))
            self.server = self.children.start("server", self.server_argv(extra), stderr_only=True)
            try:
                self.address = wait_for_address(
                    self.server, self.metrics, self.marks[-1], self.startup_timeout_s
                )
                break
            except PSError:  # killed while starting: again; failed by itself: its error stands
                if (self.server.code or 0) >= 0 or not self._restart_left():
                    raise
        self.shards = [self.children.start(n, c) for n, c in self.shard_argvs(self.address)]
        return self.address

    def start_workers(self, commands: list[tuple[str, list[str]]]) -> None:
        """Start the workers, (name, command line) each."""
        self.commands = commands
        self.workers = [self.children.start(n, c) for n, c in commands]
        self.worker_restarts = [0] * len(commands)
        self.joins_at_start = [0] * len(commands)

    def leave(self, index: int) -> None:
        """Kill worker ``index`` (SIGKILL, as a node that is gone: the server drops it as any
        dead worker) without restarting it."""
        self.away.add(index)
        self.workers[index].kill()

    def rejoin(self, index: int) -> None:
        """Start worker ``index`` again, taken out before, with its command (same name, node
        and budget)."""
        self.away.discard(index)
        self._start_again(index)

    def stop_unjoined(self) -> None:
        """Once the server has ended: stop the workers still running that have not joined since
        they last started (they would wait out their ``--connect-timeout``); they count as taken
        out, not as failed."""
        joined = self._joined()
        for index, worker in enumerate(self.workers):
            if worker.code is None and _joins(worker.name, joined) <= self.joins_at_start[index]:
                log.info("stopping %s: it had not joined when the server ended", worker.name)
                self.away.add(index)
                worker.stop()

    def _start_again(self, index: int) -> None:
        """Start worker ``index`` again with its command, noting its joins so far."""
        name = self.commands[index][0]
        self.joins_at_start[index] = _joins(name, self._joined())
        self.workers[index] = self.children.start(*self.commands[index])

    def _joined(self) -> list[str]:
        """The names in the ``join`` events since the first server started, in order."""
        return [
            str(record.get("worker"))
            for record in new_events(self.metrics, self.marks[0])
            if record.get("event") == "join"
        ]

    def wait(self, timeout_s: float) -> int:
        """Wait for the server to end, restarting what dies meanwhile.

        Args:
            timeout_s: how long each server may run.

        Returns:
            The last server's exit code.

        Raises:
            PSError: a worker failed before it joined, every worker has failed, a shard died
                with no restart left, or a restarted server did not start.
            ChildError: a server ran longer than ``timeout_s``.
        """
        assert self.server is not None
        while True:
            code = self.children.wait(self.server, timeout_s, self._check)
            if not self._restart_left():
                return code
            events = new_events(self.metrics, self.marks[-1])
            before = max((e["version"] for e in events if e["event"] in UPDATES), default=0)
            for shard in self.shards:
                shard.stop()
            resume = "--resume" if latest(self.run_dir / "checkpoints") else "--overwrite"
            self.start_server(["--bind", self.address, resume])
            events = new_events(self.metrics, self.marks[-1])
            resumed = [e["version"] for e in events if e["event"] == "resume"]
            self.versions_replayed += max(0, before - (resumed[-1] if resumed else 0))

    def _restart_left(self) -> bool:
        """Whether the server, now ended, is to be started again (the restart is counted)."""
        assert self.server is not None
        if not restart_due(self.server.code) or self.server_restarts >= self.restarts:
            return False
        self.server_restarts += 1
        log.warning(
            "%s; restarting it (%d of %d)",
            self.server.failure(),
            self.server_restarts,
            self.restarts,
        )
        return True

    def _check(self) -> None:
        """Restart the workers that died after joining (within their budget); kill the server
        when a shard died (it restarts with new shards). Raises as ``wait`` says."""
        if self.tick is not None:
            self.tick()
        present = [i for i in range(len(self.workers)) if i not in self.away]
        failed = [i for i in present if self.workers[i].code not in (None, 0)]
        if failed:
            if any(self.workers[i].name not in self.joined for i in failed):
                self.joined |= joined_names(self.metrics, self.marks[0])
            never = [self.workers[i] for i in failed if self.workers[i].name not in self.joined]
            if never:
                raise PSError("; ".join(w.failure() for w in never))
            for i in failed:
                if restart_due(self.workers[i].code) and self.worker_restarts[i] < self.restarts:
                    self.worker_restarts[i] += 1
                    log.warning("%s; restarting it", self.workers[i].failure())
                    self._start_again(i)
            if all(self.workers[i].code not in (None, 0) for i in present):
                raise PSError("; ".join(self.workers[i].failure() for i in present))
        dead = [s for s in self.shards if s.code not in (None, 0)]
        if dead and self.server_restarts < self.restarts and self.server is not None:
            log.warning("%s; restarting the server and its shards", dead[0].failure())
            self.server.kill()
        elif dead:
            raise PSError("; ".join(s.failure() for s in dead))

    def record(self) -> dict[str, int]:
        """What the summary says of the restarts: ``restarts`` (of the server),
        ``worker_restarts`` and ``versions_replayed`` (versions applied before a server died
        that the resumed server made again)."""
        return {
            "restarts": self.server_restarts,
            "worker_restarts": sum(self.worker_restarts),
            "versions_replayed": self.versions_replayed,
        }


def _joins(name: str, joined: list[str]) -> int:
    """How many of the ``joined`` names are worker ``name``'s: its own, or ``name-<id>`` when it
    rejoined while the server still counted it."""
    suffixed = re.compile(rf"{re.escape(name)}-\d+")
    return sum(n == name or suffixed.fullmatch(n) is not None for n in joined)
