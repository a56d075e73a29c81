"""The parameter server (the coordinator): it builds the run's components, each with exactly
the collaborators it uses, and owns their lifecycle.

``__init__`` builds them in order: the run directory, dataset and model; the run's books (its
record and lifecycle, sampler, roster, policy), restored from a checkpoint when resuming;
the transport and the parameter stores (its own with ``--shards 1``, else K shard servers);
then the components that act on them, sharing one ``RunContext`` and the ``RunBooks``: the
updater, evaluations, snapshots, checkpointer, ledger, task desk, departures, push path, status
view, shutdown and request handlers. Policies decide; the components act (``pserver.pushes``
carries out each push's decision).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from common import rundir, stagetrace
from common.data.dataset import DatasetReader
from common.protocol.base import Message
from common.protocol.chunks import chunk_elems_for
from common.protocol.ending import FinishReason
from common.protocol.messages import STORE_REQUESTS, WORKER_REQUESTS, DataRequest
from common.protocol.security import shard_secret
from common.protocol.shard_messages import ShardHello
from common.protocol.tokens import TokenBook, new_key
from common.training.evaluator import Evaluator
from common.training.flat import FlatLayout, nonnegative_bounds
from common.training.models import build_model, has_batchnorm
from common.training.runlog import RunLog
from pserver import checkpoint
from pserver.booking import Ledger
from pserver.checkpoint import Checkpointer
from pserver.config import ServerConfig
from pserver.context import RunBooks, RunContext
from pserver.departures import Departures
from pserver.desk import TaskDesk
from pserver.evaluation import EvalScheduler
from pserver.handlers import Admission, DataRequests, Handler, Handlers, store_routes
from pserver.membership import Roster, TaskFactory, WorkerInfo
from pserver.policies import POLICIES
from pserver.policies.weighted_sync import resolve_min_local_batch
from pserver.pushes import Pushes
from pserver.runstate import RunState
from pserver.sampler import EpochSampler
from pserver.shutdown import Shutdown, watch_shards
from pserver.snapshots.snapshot_hooks import SnapshotHook
from pserver.store.build import build_stores
from pserver.store.shards import ShardRegistry, ShardTerms
from pserver.store.stores import CapturedState
from pserver.summary import StatusView
from pserver.transport import Endpoint, Request, TaskOwner
from pserver.updates import GradientGuard, Updater

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.5


class ParameterServer:
    """Holds the run and serves workers until training ends.

    Use as ``async with ParameterServer(cfg) as ps: summary = await ps.serve()``.

    Args:
        config: the server configuration.

    Raises:
        ConfigError: the run directory or checkpoint does not fit the arguments.
        DatasetError, ModelError: the dataset or model cannot be loaded.
    """

    def __init__(self, config: ServerConfig) -> None:
        # 1. The run directory (checked; only unfinished checkpoint files are removed here:
        # start() replaces an earlier run), the dataset and the model.
        resumed = None
        if config.run_dir is not None:
            removed = checkpoint.remove_stale_tmp(config.run_dir / "checkpoints")
            if removed:
                log.warning("removed %d unfinished checkpoint files", removed)
            rundir.check(config.run_dir, resume=config.resume, overwrite=config.overwrite)
            if config.resume:
                resumed = checkpoint.read_newest(config.run_dir / "checkpoints")
        self.log = RunLog(
            config.run_dir, resume_at=resumed.meta["t"] if resumed else None, open_now=False
        )  # opened by start()
        self.reader = DatasetReader(config.dataset, cache_bytes=config.cache_mb << 20)
        self.meta = meta = self.reader.meta
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        channels, height, _ = meta.shape
        model = build_model(config.model, channels, meta.num_classes, height)
        self.config = config = resolve_min_local_batch(config, has_batchnorm(model))
        layout = FlatLayout(model)
        self.num_params, self.state_size = layout.num_params, layout.size
        self.nonneg = nonnegative_bounds(model, layout)
        train_count = len(self.reader.train_indices)

        # 2. The run's books, restored when resuming.
        self.run = RunState()
        self.sampler = EpochSampler(train_count, config.seed, max_epochs=config.epochs)
        self.tasks = TaskFactory(self.reader.train_indices)
        self.policy = POLICIES[config.mode](config, self.sampler, tasks=self.tasks)
        self.tokens = TokenBook(new_key())
        self.store_tokens = self.tokens.derive("store")  # what the stores (and shards) check
        self.roster = Roster(
            config.dead_after_s, self._on_dead, tokens=self.tokens, max_members=config.max_workers
        )
        identity = checkpoint.identity_of(config, meta.fingerprint, self.state_size)
        self.initial = CapturedState(0, 0, [], layout.read_state().numpy(), np.zeros((0, 0)))
        if resumed is not None:
            self.initial = checkpoint.restore(
                resumed, identity, self.sampler, self.run, self.roster, self.policy, self.log
            )

        # 3. The transport and the parameter stores.
        stagetrace.start("server")
        self.owner = TaskOwner()
        chunk_elems = chunk_elems_for(config.chunk_bytes, config.wire_dtype)
        self.endpoint = Endpoint(
            config.bind,
            {**WORKER_REQUESTS, **STORE_REQUESTS, ShardHello.TYPE: ShardHello},
            max_message_bytes=chunk_elems * 4 + (4 << 20),
            owner=self.owner,
            curve_secret=config.curve_secret,
            authorized_keys=config.authorized_keys,
            allow_own_key=config.shards > 1,  # shards hold the server's key pair
        )
        shard_key = new_key()
        self.stores, remote = build_stores(
            config,
            self.initial,
            self.num_params,
            self.nonneg,
            chunk_elems,
            shard_key,
            self.store_tokens,
            self.endpoint,
        )
        self.shards = (
            ShardRegistry(
                config,
                remote,
                secret=shard_secret(config.shard_secret_file, config.curve_secret),
                terms=ShardTerms(
                    shard_key, self.store_tokens.key, self.initial, self.nonneg, chunk_elems
                ),
                zmq_context=self.endpoint.context,
                run=self.run,
                log=self.log,
                replier=self.endpoint,
            )
            if remote is not None
            else None
        )

        # 4. The components that act on the run.
        self.updater = Updater(config, self.stores, train_count=train_count)
        self.updater.restore(
            self.initial.version,
            int(resumed.meta["steps"]) if resumed else 0,
            int(resumed.meta["samples_applied"]) if resumed else 0,
        )
        self.guard = GradientGuard(config.max_grad_norm, config.outlier_factor)
        self.evaluations = EvalScheduler(
            Evaluator(model, self.reader, num_classes=meta.num_classes, batch=config.eval_batch),
            self.log,
            fetch=self.stores.newest_state,
            subset_size=config.eval_samples,
            seed=config.seed,
            on_record=self._on_eval,
            keep_best=None
            if config.run_dir is None or not config.keep_best
            else checkpoint.BestCheckpoint(
                config.run_dir / "checkpoints",
                identity,
                write_timeout_s=config.write_timeout_s,
                resumed=bool(resumed),
            ).offer,
        )
        context = RunContext(
            config, self.run, self.log, self.finish, self.fail, self._checkpoint_soon
        )
        books = RunBooks(self.sampler, self.roster, self.policy, self.updater)
        self.snapshots = SnapshotHook(
            context,
            self.updater,
            info={
                "mode": config.mode,
                "model": config.model,
                "dataset": str(config.dataset.resolve()),
                "fingerprint": meta.fingerprint,
                "state_size": self.state_size,
            },
            resumed_at=self.initial.version if resumed else None,
            evaluations=self.evaluations,
            newest_state=self.stores.newest_state,
        )
        self.checkpointer = Checkpointer(context, books, identity=identity, stores=self.stores)
        self.ledger = Ledger(
            config,
            self.log,
            run=self.run,
            sampler=self.sampler,
            roster=self.roster,
            updater=self.updater,
            evaluations=self.evaluations,
        )
        self.desk = TaskDesk(
            self.roster,
            self.policy,
            replier=self.endpoint,
            store_tokens=self.store_tokens,
            updater=self.updater,
            run=self.run,
            log=self.log,
            whole_params=self.stores.fused_params,
        )
        self.departures = Departures(
            books, self.log, guard=self.guard, stores=self.stores, owner=self.owner, desk=self.desk
        )
        self.pushes = Pushes(
            context,
            books,
            stores=self.stores,
            guard=self.guard,
            ledger=self.ledger,
            desk=self.desk,
            snapshots=self.snapshots,
            departures=self.departures,
        )
        self.status = StatusView(
            context,
            books,
            meta=meta,
            stores=self.stores,
            guard=self.guard,
            evaluations=self.evaluations,
            snapshots=self.snapshots,
        )
        self.shutdown = Shutdown(
            context,
            self.roster,
            updater=self.updater,
            evaluations=self.evaluations,
            snapshots=self.snapshots,
            final_checkpoint=self.checkpointer.save if config.run_dir is not None else None,
            stop_waiting=self.desk.stop_waiting,
            summary=self.status.summary,
        )
        mean, std = self.reader.codec.wire_stats()
        join_terms = {
            "mode": config.mode,
            "model": config.model,
            "in_channels": channels,
            "num_classes": meta.num_classes,
            "input_size": height,
            "state_size": self.state_size,
            "num_params": self.num_params,
            "dataset_fingerprint": meta.fingerprint,
            "seed": config.seed,
            "server_id": secrets.token_hex(8),
            "heartbeat_s": config.heartbeat_s,
            "dead_after_s": config.dead_after_s,
            "wire_dtype": config.wire_dtype,
            "chunk_elems": chunk_elems,
            "sample_dtype": self.reader.codec.dtype,
            "norm_mean": mean,
            "norm_std": std,
        }
        admission = Admission(self.tokens, self.store_tokens, join_terms, self.stores)
        self.handlers = Handlers(
            context,
            books,
            endpoint=self.endpoint,
            admission=admission,
            status=self.status,
            desk=self.desk,
            departures=self.departures,
        )
        self.data = DataRequests(self.reader, self.roster, endpoint=self.endpoint)
        self.routes: dict[type[Message], Handler] = {
            **self.handlers.routes,
            **store_routes(self.stores, self.pushes, self.shards),
            DataRequest: self.data.data,
        }
        self.http: Any = None  # the status page (pserver.observe.statuspage), with --http
        self.address = ""
        self._flusher: asyncio.TimerHandle | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket, then write the run directory; ``self.address`` is then the endpoint
        workers connect to. Nothing is written into the run directory before this point, so a
        start that fails (a bad input, a port in use) leaves it as it was.

        Raises:
            ConfigError: the address (or the status page's port) cannot be bound.
        """
        if self.config.http_port is not None:
            from pserver.observe.statuspage import start_page

            self.http = await start_page(
                self.status.status, self.log, self.config.http_bind, self.config.http_port
            )
        self.address = self.endpoint.bind()
        run_dir = self.config.run_dir
        if run_dir is not None and not self.config.resume:  # --overwrite, or a failed start's
            removed = rundir.clear(run_dir)
            if removed:
                log.info("removed %s from %s", ", ".join(removed), run_dir)
        self.log.open()
        self.snapshots.open()
        warm = self.reader.train_indices[:1]
        self.owner.spawn(asyncio.get_running_loop().run_in_executor(None, self.reader.read, warm))
        c = self.config  # the rule async pushes are judged by, for readers of the history
        rule = {
            "function": c.staleness,
            "a": c.staleness_a,
            "b": c.staleness_b,
            "max": c.max_staleness,
        }
        self.log.event(
            "start",
            address=self.address,
            mode=self.config.mode,
            model=self.config.model,
            dataset=str(self.config.dataset),
            state_size=self.state_size,
            shards=self.config.shards,
            wire_dtype=self.config.wire_dtype,
            train=len(self.reader.train_indices),
            test=len(self.reader.test_indices),
            global_batch=self.config.global_batch,
            staleness=None if self.config.is_sync else rule,
            plan={"planner": c.planner, "spread": c.plan_spread, "min_batch": c.min_local_batch},
        )
        self._schedule_flush()
        log.info(
            "serving %s on %s (%d parameters and buffers, %d training samples, %d shard%s)",
            self.config.mode,
            self.address,
            self.state_size,
            len(self.reader.train_indices),
            self.config.shards,
            "" if self.config.shards == 1 else "s",
        )
        if self.run.finished:  # resumed a run that had already ended
            log.info("the run had already ended (%s); writing its summary", self.run.finish_reason)
            self.owner.spawn(self.shutdown.run_to_end())
        elif self.shards is not None:
            self.owner.spawn(
                watch_shards(
                    self.shards.stores,
                    self.config.heartbeat_s,
                    self.run,
                    lambda why: self.fail(why, stores_lost=True),
                )
            )

    def _schedule_flush(self) -> None:
        self.log.flush()
        self._flusher = asyncio.get_running_loop().call_later(FLUSH_EVERY_S, self._schedule_flush)

    async def serve(self) -> dict[str, Any]:
        """Serve until training has ended and the summary is written.

        Returns:
            The run summary (also written to ``summary.json``).
        """
        receiver = asyncio.create_task(self.endpoint.receive_loop(self._dispatch))
        try:
            await self.shutdown.done.wait()
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return self.status.summary()

    def request_stop(self) -> None:
        """End training now (signals call this); shutdown then proceeds within its timeout."""
        self.finish(FinishReason.STOPPED)

    async def close(self) -> None:
        """Cancel outstanding tasks, close the sockets and the dataset."""
        if self.http is not None:
            await self.http.close()
        if self._flusher is not None:
            self._flusher.cancel()
        await self.evaluations.close()
        self.snapshots.close(1.0)  # drained (or abandoned) within the shutdown budget
        await self.owner.cancel_all()
        await self.stores.close("the server closed")
        self.roster.close()
        self.endpoint.close()
        self.reader.close()
        self.log.close()

    async def __aenter__(self) -> ParameterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def done(self) -> asyncio.Event:
        """Set once the run has ended and its summary is written."""
        return self.shutdown.done

    # --- what the server does ---------------------------------------------------------------

    def _dispatch(self, request: Request, message: Message) -> Awaitable[None]:
        return self.routes[type(message)](request, message)

    def _on_dead(self, worker: WorkerInfo) -> None:
        self.departures.drop(worker, f"dead: silent for {self.config.dead_after_s:g} s")

    def _on_eval(self, record: dict[str, Any]) -> None:
        self.run.evals.append(record)
        target = self.config.target_oa
        if target is not None and record["oa"] >= target and self.run.time_to_target is None:
            self.run.time_to_target = record["train_t"]
            self.finish(FinishReason.TARGET_OA)

    def _checkpoint_soon(self) -> None:
        self.owner.spawn(self.checkpointer.save())

    def finish(self, reason: FinishReason) -> None:
        """End training: no more tasks; waiting workers are told to stop; the end begins.

        Args:
            reason: why (``FAILED``: ``fail`` recorded what went wrong).
        """
        if not self.run.finish(reason, self.log.now()):
            return
        log.info("training finished (%s) at version %d", self.run.finish_reason, self.version)
        self.log.event("finish", reason=self.run.finish_reason, version=self.version)
        self.desk.dispatch()
        self.owner.spawn(self.shutdown.run_to_end())

    def fail(self, reason: str, stores_lost: bool = False) -> None:
        """End the run because of an error; the server will exit non-zero.

        Args:
            reason: what went wrong (logged and kept in the summary).
            stores_lost: a shard is gone, so no final checkpoint or evaluation is possible
                (the last periodic checkpoint is the one to resume from).
        """
        log.error("%s", reason)
        self.run.fail(reason, stores_lost)
        self.finish(FinishReason.FAILED)

    @property
    def version(self) -> int:
        """The published version."""
        return self.updater.version


async def run_server(
    config: ServerConfig, listening: Callable[[str, Callable[[], None]], None]
) -> tuple[dict[str, Any], str]:
    """Run a server from start to close.

    Args:
        config: the server configuration.
        listening: called once the server listens, with its address and the call that stops
            training (for signal handlers).

    Returns:
        The run summary and the run's error ("" when it did not fail).

    Raises:
        ConfigError, DatasetError, ModelError: as ``ParameterServer``.
    """
    async with ParameterServer(config) as server:
        listening(server.address, server.request_stop)
        summary = await server.serve()
        return summary, server.run.error
