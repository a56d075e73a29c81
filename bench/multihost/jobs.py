"""The multi-host bench's jobs: the gloo baseline and one parameter-server run."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from bench.multihost import start
from bench.multihost.config import BenchConfig, Variant
from common import stagetrace
from common.procs import Child, ChildError, python_module
from common.protocol.security import write_shard_secret
from common.training.rounds import breakdown, round_events
from launch.cluster.netns import Network
from launch.procs import EventsMark, wait_for_address

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 120.0
# The rendezvous port of the gloo ranks: fixed, because it lives on an address inside a
# namespace this bench created, where nothing else can hold it.
GLOO_PORT = 29517


def _stop_all(children: list[Child]) -> None:
    for child in reversed(children):
        child.stop()


def run_gloo(net: Network, cfg: BenchConfig, dataset: Path, log_dir: Path) -> dict[str, Any]:
    """The DDP baseline: one gloo rank per worker host, reading the dataset's local copy.

    Args:
        net: the emulated hosts (host 0, the server host, takes no part).
        cfg: the bench settings.
        dataset: the dataset file (the same path is every host's local copy).
        log_dir: receives each rank's log.

    Returns:
        Rank 0's result: params, compute_s (per rank, solo), allreduce_s, ddp_step_s.

    Raises:
        ChildError: a rank failed or the job outlived ``cfg.job_timeout``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    hosts = net.hosts[1:]
    children: list[Child] = []
    try:
        for rank, host in enumerate(hosts):
            argv = python_module(
                "bench.multihost.gloo",
                *("--rank", str(rank), "--world", str(len(hosts)), "--master", hosts[0].address),
                *("--port", str(GLOO_PORT), "--dataset", str(dataset), "--model", cfg.model),
                *("--batch", str(cfg.batch), "--threads", str(cfg.threads)),
                *("--compute-steps", str(max(5, cfg.steps // 2))),
                *("--allreduce-repeats", str(cfg.steps), "--ddp-steps", str(cfg.steps)),
                *("--timeout", str(cfg.job_timeout)),
            )
            env = {"GLOO_SOCKET_IFNAME": host.interface}
            children.append(start(f"gloo{rank}", host.argv(argv), log_dir / f"gloo{rank}.log", env))
        line = children[0].wait_for_match(r"^RESULT (\{.*\})$", cfg.job_timeout)
        codes = [child.wait(EXIT_TIMEOUT_S) for child in children]
        if any(codes):
            raise ChildError(f"gloo rank exit codes {codes}; logs in {log_dir}")
        return json.loads(line.group(1))
    finally:
        _stop_all(children)


def run_ps(
    net: Network,
    cfg: BenchConfig,
    variant: Variant,
    dataset: Path,
    run_dir: Path,
    batch: int | None = None,
) -> dict[str, Any]:
    """One parameter-server run in ``cfg.mode``: ``pserver start`` on host 0, ``worker join``
    on each worker host, ``pserver shard`` where the variant puts shards; ``cfg.steps`` updates.

    Args:
        net: the emulated hosts.
        cfg: the bench settings.
        variant: what to run.
        dataset: the dataset file (served by the server; the workers' local copy if asked).
        run_dir: the server's run dir; the processes' logs go there too.
        batch: samples per worker per step (default ``cfg.batch``).

    Returns:
        ``{"round_s", "compute_s", "comm_s", "batches", "compute_source"}``: per
        measured round its time, the slowest worker's compute and the rest; per worker its
        median batch.

    Raises:
        ChildError: a process failed, or the run outlived ``cfg.job_timeout``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = run_dir / "shard.secret"
    secret.unlink(missing_ok=True)
    write_shard_secret(secret)  # proved by the shards (started only when the variant has some)
    server_host, workers = net.hosts[0], net.hosts[1:]
    n = len(workers)
    children: list[Child] = []
    started = time.monotonic()
    # With stage tracing on, each run's processes mark their stages in the run's own folder.
    env = {stagetrace.ENV: str(run_dir / "trace")} if stagetrace.enabled() else None
    try:
        mark = EventsMark(run_dir / "metrics.jsonl")
        argv = python_module(
            "pserver.cli",
            *("start", "--bind", f"tcp://{server_host.address}:0", "--dataset", str(dataset)),
            *("--model", cfg.model, "--mode", cfg.mode, "--workers", str(n)),
            *("--global-batch", str((batch or cfg.batch) * n), "--max-steps", str(cfg.steps)),
            *("--eval-every", "1000000", "--torch-threads", "1", "--shutdown-timeout", "120"),
            *("--run-dir", str(run_dir), "--shard-secret-file", str(secret)),
            *variant.server_options(net.config.rates),
        )
        server = start("server", server_host.argv(argv), run_dir / "server.log", env)
        children.append(server)
        endpoint = wait_for_address(server, run_dir / "metrics.jsonl", mark, STARTUP_TIMEOUT_S)
        mark.close()
        shards = []
        for index in variant.shard_hosts(net.config.rates):
            host = net.hosts[index]
            argv = python_module(
                *("pserver.cli", "shard", "--coordinator", endpoint),
                *("--bind", f"tcp://{host.address}:0", "--secret-file", str(secret)),
            )
            shards.append(
                start(f"shard@{host.netns}", host.argv(argv), run_dir / f"shard{index}.log", env)
            )
            children.append(shards[-1])
        joined = []
        for i, host in enumerate(workers, start=1):
            argv = python_module(
                *("worker.cli", "join", "--server", endpoint, "--name", f"w{i}"),
                *("--threads", str(cfg.threads), "--log-every", "1000000"),
            )
            if variant.local_data:
                argv += ["--data", str(dataset)]
            joined.append(start(f"w{i}", host.argv(argv), run_dir / f"w{i}.log", env))
            children.append(joined[-1])
        code = server.wait(max(1.0, cfg.job_timeout - (time.monotonic() - started)))
        codes = [child.wait(EXIT_TIMEOUT_S) for child in joined]
        if code or any(codes):
            raise ChildError(
                f"{variant.name}: server exit code {code}, worker exit codes {codes}\n"
                f"{server.tail()}\n" + "\n".join(child.tail(10) for child in joined)
            )
        for shard in shards:
            shard.wait(EXIT_TIMEOUT_S)
        return _rounds(run_dir, cfg.warmup)
    finally:
        _stop_all(children)


def _rounds(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Round times, the slowest worker's compute per round and their difference.

    A worker's compute comes from its entry in the round record (``rounds.breakdown``): its
    ``compute_s`` once the server logs it, else estimated as batch / speed.
    """
    rounds = round_events(run_dir)[warmup:]
    if not rounds:
        raise ChildError(f"{run_dir} holds no rounds past the {warmup} warm-up rounds")
    parts = [breakdown(r) for r in rounds]
    round_s = [float(r["round_s"]) for r in rounds]
    compute_s = [max((w.compute_s for w in ws), default=0.0) for ws in parts]
    batches: dict[str, list[int]] = {}
    for w in itertools.chain(*parts):
        batches.setdefault(w.worker, []).append(w.batch)
    estimated = any(w.compute_estimated for ws in parts for w in ws)
    return {
        "round_s": round_s,
        "compute_s": compute_s,
        "comm_s": [t - c for t, c in zip(round_s, compute_s, strict=True)],
        "batches": {name: statistics.median(b) for name, b in sorted(batches.items())},
        "compute_source": "batch / speed" if estimated else "round records",
    }
