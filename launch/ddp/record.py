"""Rank 0's record of a DDP run: metrics.jsonl events, evaluations and summary.json."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from torch.optim import Optimizer

from common.protocol.ending import FinishReason
from common.training.evaluator import Evaluator, record_evaluation
from common.training.flat import FlatLayout
from common.training.runlog import RunLog
from common.training.speed import SpeedMeter
from common.training.summary import per_class_of, run_summary
from launch.ddp import checkpoint
from launch.ddp.config import DDPConfig
from launch.ddp.step import StepResult
from pserver.checkpoint import check_identity
from pserver.snapshots.snapshots import SnapshotMeta, SnapshotWriter

log = logging.getLogger(__name__)


class RunRecorder:
    """Writes what the parameter server writes, in the same format (docs/run-files.md).

    Evaluation blocks training here (the other ranks wait for rank 0), so its time is kept
    out of the training clock: ``train_time_s`` and ``time_to_target_s`` exclude it, and every
    eval event carries ``train_t``, the training time at that point. ``t`` of an eval event is,
    as on the server, the moment its parameters were taken.

    Args:
        config: the run's configuration.
        evaluator: scores a flat state on the test split.
        layout: the training model's flat layout (to read its state).
    """

    def __init__(self, config: DDPConfig, evaluator: Evaluator, *, layout: FlatLayout) -> None:
        self.config = config
        self.evaluator = evaluator
        self.layout = layout
        # Nothing is written before training starts (a failed start leaves no run behind);
        # with ``config.origin`` the clock is the launcher's, the same for every restart.
        self.log = RunLog(config.run_dir, resume_at=0.0 if config.resume else None, open_now=False)
        if config.origin is not None:
            self.log.started = config.origin
        self.world_size = config.world_size
        self.speeds = [SpeedMeter() for _ in range(self.world_size)]
        self.samples = [0] * self.world_size
        self.pushes = [0] * self.world_size
        self.round_times: list[float] = []
        self.evals: list[dict[str, Any]] = []
        self.eval_total_s = 0.0
        self.checkpoint_total_s = 0.0  # checkpoint writes block training as evaluations do
        self.train_start = 0.0
        self.time_to_target: float | None = None
        self.epochs_done = 0
        self.last_shares: list[int] = []
        meta = evaluator.reader.meta
        self.snapshots: SnapshotWriter | None = None
        self.identity = {
            "mode": config.mode,
            "model": config.model,
            "fingerprint": meta.fingerprint,
            "state_size": layout.size,
            "seed": config.train.seed,
            "global_batch": config.train.global_batch,
            "optimizer": config.train.optimizer,
        }
        self.resumed_at: int | None = None
        self.others: dict[str, list[Any]] = {}
        self.log.event(
            "start",
            mode=config.mode,
            model=config.model,
            dataset=str(config.dataset),
            backend=config.resolved_backend(),
            world_size=self.world_size,
            state_size=layout.size,
            train=meta.train_count,
            test=meta.test_count,
        )
        for rank in range(self.world_size):
            self.log.event(
                "join",
                worker=config.rank_name(rank),
                device=config.device_of(rank),
                slowdown=config.slowdowns[rank],
                rank=rank,
            )

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue the record a checkpoint's ``meta`` holds (``state`` wrote it): its
        counters, evaluations and clock, each rank's by its name.

        Raises:
            ConfigError: the checkpoint is another run's (``check_identity``).
        """
        check_identity(meta, self.identity)
        record = meta["record"]
        self.train_start, self.eval_total_s = record["train_start"], record["eval_total_s"]
        self.checkpoint_total_s = record["checkpoint_total_s"]
        self.time_to_target, self.epochs_done = record["time_to_target"], meta["epoch"] - 1
        self.evals, self.round_times = record["evals"], record["round_times"]
        self.others = dict(record["workers"])  # ranks outside this group keep their counts
        for rank in range(self.world_size):
            saved = self.others.pop(self.config.rank_name(rank), None)
            if saved is not None:
                self.samples[rank], self.pushes[rank], self.speeds[rank].speed = saved
        if meta["cursor"] == self.evaluator.reader.meta.train_count:
            self.epochs_done += 1
        self.resumed_at = meta["version"]
        self.log.event("resume", **{k: meta[k] for k in ("version", "epoch", "samples")})

    def state(self) -> dict[str, Any]:
        """What ``restore`` continues from."""
        workers = {
            self.config.rank_name(r): [self.samples[r], self.pushes[r], self.speeds[r].speed]
            for r in range(self.world_size)
        }
        workers.update(self.others)
        return {
            "train_start": self.train_start,
            "eval_total_s": self.eval_total_s,
            "checkpoint_total_s": self.checkpoint_total_s,
            "time_to_target": self.time_to_target,
            "evals": self.evals,
            "round_times": self.round_times,
            "workers": workers,
        }

    def checkpoint(
        self, epoch: int, cursor: int, version: int, samples: int, optimizer: Optimizer
    ) -> None:
        """Write a checkpoint of the run at this step (a failure is logged; training goes on).

        Args:
            epoch, cursor: the epoch in progress and how many of its samples are done.
            version, samples: steps and training samples applied.
            optimizer: the optimizer whose state is saved.
        """
        begin, t = time.perf_counter(), self.log.now()
        meta: dict[str, Any] = {"version": version, "epoch": epoch, "cursor": cursor}
        meta["samples"] = samples
        meta.update(self.identity, t=self.log.now(), record=self.state())
        try:
            path = checkpoint.save(self.config.run_dir, self.layout, optimizer, meta)
        except OSError as exc:
            log.error("checkpoint failed: %s", exc)
            self.log.event("checkpoint_failed", error=str(exc)[:300])
            return
        finally:
            self.checkpoint_total_s += self.log.now() - t
        write_s = round(time.perf_counter() - begin, 4)
        self.log.event(
            "checkpoint", version=version, samples=samples, path=str(path), write_s=write_s
        )

    def train_started(self) -> None:
        """Every rank is ready: the run's files are opened and the training clock starts (a
        resumed run's clock goes on)."""
        self.log.open()
        if self.resumed_at is None:
            self.train_start = self.log.now()
        self.log.event("train_start", workers=self.world_size, version=self.resumed_at or 0)
        if self.config.snapshot_every_steps is not None:
            info = {**self.identity, "dataset": str(self.config.dataset.resolve())}
            self.snapshots = SnapshotWriter(
                self.config.run_dir,
                self.config.snapshot_every_steps,
                limit=self.config.snapshot_limit,
                info=info,
                resumed_at=self.resumed_at,
            )

    def train_clock(self, t: float) -> float:
        """Training time at log time ``t``: since the start, minus blocking evaluations and
        checkpoint writes."""
        return max(t - self.train_start - self.eval_total_s - self.checkpoint_total_s, 0.0)

    def round(
        self, epoch: int, version: int, batches: list[int], result: StepResult, round_s: float
    ) -> None:
        """Record one step: every rank's local batch, speed and compute time.

        Args:
            epoch: the epoch of the step's samples.
            version: updates applied so far (this step included).
            batches: per rank, its local batch.
            result: the step's per-rank timings.
            round_s: the step's wall time on rank 0.
        """
        self.round_times.append(round_s)
        workers = []
        for rank, batch in enumerate(batches):
            if batch:
                self.speeds[rank].update(batch, result.emulated_s[rank])
                self.samples[rank] += batch
                self.pushes[rank] += 1
            workers.append(
                {
                    "worker": self.config.rank_name(rank),
                    "batch": batch,
                    "speed": round(self.speeds[rank].speed, 3),
                    "compute_s": round(result.compute_s[rank], 6),
                    "emulated_s": round(result.emulated_s[rank], 6),
                }
            )
        self.log.event(
            "round",
            round=version,
            epoch=epoch,
            version=version,
            round_s=round(round_s, 6),
            loss=round(result.loss, 6),
            workers=workers,
        )
        self.log.flush()  # where a launcher following the run reads it

    def shares(self, batches: list[int], speeds: list[float], source: str) -> None:
        """Record weighted DDP's split of the global batch: every rank's local batch and the
        speed it came from (``source``: ``given``, ``probe`` or ``epoch``)."""
        self.last_shares = batches
        self.log.event(
            "shares",
            source=source,
            workers=[
                {"worker": self.config.rank_name(r), "batch": b, "speed": round(s, 3)}
                for r, (b, s) in enumerate(zip(batches, speeds, strict=True))
            ],
        )

    def snapshot(self, epoch: int, version: int, samples: int, final: bool = False) -> None:
        """Save this step's state when the interval keeps it (written on another thread)."""
        writer = self.snapshots
        if writer is None or not (
            writer.due(version) or (final and version not in writer.versions)
        ):
            return
        train_t = round(self.train_clock(self.log.now()), 6)
        state = self.layout.read_state().numpy()
        writer.submit(SnapshotMeta(version, epoch, samples, train_t, final), state)

    def _evaluate(self, epoch: int, version: int, samples: int) -> dict[str, Any]:
        t = self.log.now()
        train_t = self.train_clock(t)
        begin = time.perf_counter()
        scores = self.evaluator.evaluate(self.layout.read_state().numpy())
        eval_s = time.perf_counter() - begin
        self.eval_total_s += self.log.now() - t
        record = record_evaluation(
            self.log,
            scores,
            t=t,
            version=version,
            epoch=epoch,
            samples=samples,
            eval_s=eval_s,
            train_t=round(train_t, 6),
        )
        self.evals.append(record)
        return record

    def epoch_done(self, epoch: int, version: int, samples: int) -> bool:
        """Record the end of an epoch and evaluate.

        Args:
            epoch: the epoch that ended.
            version: updates applied so far.
            samples: training samples applied so far.

        Returns:
            True when the target accuracy is now reached (training should stop).
        """
        self.epochs_done = max(self.epochs_done, epoch)
        self.log.event(
            "epoch",
            epoch=epoch,
            samples=samples - (epoch - 1) * self.evaluator.reader.meta.train_count,
            exactly_once=True,
            version=version,
        )
        record = self._evaluate(epoch, version, samples)
        target = self.config.train.target_oa
        if target is not None and record["oa"] >= target and self.time_to_target is None:
            self.time_to_target = record["train_t"]
            return True
        return False

    def finish(self, reason: FinishReason, epoch: int, version: int, samples: int) -> None:
        """Evaluate the final parameters if needed, then write ``summary.json``.

        Args:
            reason: why training ended (``INTERRUPTED``: the last evaluation stands for the
                final one).
            epoch: the last epoch reached.
            version: updates applied.
            samples: training samples applied.
        """
        train_end = self.log.now()
        train_time = self.train_clock(train_end)
        log.info("training finished (%s) at version %d", reason.value, version)
        self.snapshot(epoch, version, samples, final=True)
        evaluated = self.evals and self.evals[-1]["version"] == version
        if not evaluated and reason is not FinishReason.INTERRUPTED:  # end within the grace period
            self._evaluate(epoch, version, samples)
        for rank in range(self.world_size):
            self.log.event("leave", worker=self.config.rank_name(rank), reason="stop")
        self.log.write_summary(self._summary(reason, version, samples, train_time))

    def _summary(
        self, reason: FinishReason, version: int, samples: int, train_time: float
    ) -> dict[str, Any]:
        """The shared summary schema, for mode ``ddp`` or ``weighted-ddp``."""
        times = np.array(self.round_times) if self.round_times else np.zeros(1)
        nodes = self.config.nodes
        summary = run_summary(
            mode=self.config.mode,
            model=self.config.model,
            dataset=str(self.config.dataset),
            wall_time_s=self.log.now(),
            train_time_s=train_time,
            steps=version,
            epochs=self.epochs_done,
            samples_seen=samples,
            evals=self.evals,
            target_oa=self.config.train.target_oa,
            time_to_target_s=self.time_to_target,
            workers=[
                {
                    "name": self.config.rank_name(rank),
                    "device": self.config.device_of(rank),
                    "slowdown": self.config.slowdowns[rank],
                    "cpus": nodes and nodes.workers[rank].cpus,  # null when not emulated
                    "link": nodes and nodes.workers[rank].link,
                    "speed": round(self.speeds[rank].speed, 3),
                    "samples": self.samples[rank],
                    "pushes": self.pushes[rank],
                    "rejected": 0,
                    "active": False,
                }
                for rank in range(self.world_size)
            ],
            staleness=None,
            finish_reason=reason.value,
            global_batch=self.config.train.global_batch,
            per_class=per_class_of(self.evals, self.evaluator.reader.meta.class_names),
            details={
                "rounds": len(self.round_times),
                "round_s_median": float(np.median(times)),
                "round_s_mean": float(times.mean()),
                "world_size": self.world_size,
                "backend": self.config.resolved_backend(),
                "eval_s_total": round(self.eval_total_s, 4),
                "checkpoint_s_total": round(self.checkpoint_total_s, 4),
                "slowdown": "compute-only (launch.ddp.step)",
                "grad_compression": self.config.grad_compression,
                **(
                    {"shares": self.last_shares, "rebalance": self.config.rebalance}
                    if self.config.weighted
                    else {}
                ),
            },
        )
        if nodes is not None:
            summary["cluster"] = nodes.describe()
        return summary

    def close(self) -> None:
        """Finish the snapshot writes; close ``metrics.jsonl``."""
        if self.snapshots is not None:
            self.snapshots.close()
        self.log.close()
