"""Atomic checkpoints of a run, gathered at one version, and restoring a server from them.

A checkpoint is one ``.npz`` file (no pickle: numeric arrays plus a JSON document stored as
bytes) written to a temporary name, fsynced and renamed, so a crash never leaves a torn file;
reading falls back to the previous checkpoint when the newest is damaged. It holds the whole
state (gathered from every shard while no update is being published, so it resumes with any
number of shards), the optimizer state, the counters, the epoch ledgers (samples handed out but
not applied are handed out again on resume, so each epoch still uses every sample once), the
random-number state, the evaluations and each worker's counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ConfigError, PSError
from common.safefile import run_bounded, write_atomic
from common.training.runlog import RunLog
from pserver.config import ServerConfig
from pserver.context import RunBooks, RunContext
from pserver.membership import Roster
from pserver.policies import ModePolicy
from pserver.runstate import RunState
from pserver.sampler import EpochLedger, EpochSampler
from pserver.store.stores import CapturedState, ParameterStores

log = logging.getLogger(__name__)

FORMAT = 2
KEEP = 3
BEST = "best.npz"  # beside the newest checkpoints, never pruned; not resumed from
NAME = re.compile(r"^ckpt-(\d{10})\.npz$")
TMP = re.compile(r"^\.ckpt-\d{10}\.npz\.tmp$")


@dataclasses.dataclass
class Checkpoint:
    """Everything a server needs to continue a run.

    Attributes:
        arrays: ``state``, ``slots`` (optimizer state, one row per slot), ``uses/<epoch>``
            ledgers, ``torch_rng``.
        meta: JSON-able counters, identities and history.
    """

    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]

    @property
    def version(self) -> int:
        """The parameter version saved."""
        return int(self.meta["version"])


def capture_sampler(sampler: EpochSampler) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The sampler's position and per-epoch ledgers (call on the event loop)."""
    arrays = {f"uses/{e}": ledger.uses.copy() for e, ledger in sampler.ledgers.items()}
    meta = {
        "epoch": sampler.epoch,
        "cursor": sampler.cursor,
        "applied": {str(e): ledger.applied for e, ledger in sampler.ledgers.items()},
    }
    return arrays, meta


def restore_sampler(
    sampler: EpochSampler, arrays: dict[str, np.ndarray], meta: dict[str, Any]
) -> int:
    """Put ``sampler`` back where the checkpoint left it.

    Samples handed out but never applied are queued to be handed out first.

    Returns:
        How many samples were queued again.
    """
    sampler.seek(int(meta["epoch"]), int(meta["cursor"]))
    requeued = 0
    for key, applied in meta["applied"].items():
        epoch = int(key)
        uses = arrays[f"uses/{epoch}"].astype(np.int32)
        ledger = EpochLedger(
            epoch, sampler.num_samples, handed_out=applied, applied=applied, uses=uses
        )
        sampler.ledgers[epoch] = ledger
        if epoch == sampler.epoch:
            handed = sampler.permutation(epoch)[: sampler.cursor]
            unapplied = handed[uses[handed] == 0]
        else:
            unapplied = np.flatnonzero(uses == 0)
        if len(unapplied):
            ledger.handed_out += len(unapplied)  # give_back subtracts them again
            sampler.give_back(epoch, unapplied.astype(np.int64))
            requeued += len(unapplied)
    return requeued


def _write_npz(path: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` (its meta as JSON bytes) atomically and synced to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = json.dumps({"format": FORMAT, **checkpoint.meta}).encode()
    arrays = {"meta": np.frombuffer(document, dtype=np.uint8), **checkpoint.arrays}
    fill = lambda handle: np.savez(handle, **arrays)  # type: ignore[arg-type]  # noqa: E731
    return write_atomic(path, fill, sync=True)


def write(directory: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` atomically as ``ckpt-<version>.npz``; keep the newest few.

    Returns:
        The path written.

    Raises:
        OSError: the file could not be written (no temporary file is left behind).
    """
    path = _write_npz(directory / f"ckpt-{checkpoint.version:010d}.npz", checkpoint)
    for old in _listed(directory)[:-KEEP]:
        old.unlink()
    return path


def remove_stale_tmp(directory: Path) -> int:
    """Delete temporary files left by an interrupted write; returns how many."""
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if TMP.match(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def _listed(directory: Path) -> list[Path]:
    """The checkpoints in ``directory``, oldest first (none when it does not exist)."""
    return sorted(p for p in directory.glob("ckpt-*.npz") if NAME.match(p.name))


def latest(directory: Path) -> Path | None:
    """The newest checkpoint in ``directory``, or None."""
    return next(reversed(_listed(directory)), None)


def read(path: Path) -> Checkpoint:
    """Load a checkpoint written by ``write``.

    Raises:
        ConfigError: the file is damaged or not a checkpoint of a known format.
    """
    try:  # our handle: numpy leaves its own open when the zip directory is damaged
        with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (OSError, ValueError, KeyError, EOFError, MemoryError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {str(path)!r} has an unknown format")
    return Checkpoint(arrays, meta)


def read_newest(directory: Path) -> Checkpoint:
    """The newest readable checkpoint; a damaged newer one is skipped with a warning.

    Raises:
        ConfigError: there is none.
    """
    for path in reversed(_listed(directory)):
        try:
            return read(path)
        except ConfigError as exc:
            log.warning("%s; trying the previous checkpoint", exc)
    raise ConfigError(f"--resume: no readable checkpoint in {directory}")


# --- a run's checkpoints --------------------------------------------------------------------


def identity_of(config: ServerConfig, fingerprint: str, state_size: int) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed by a server.

    Args:
        config: the server's configuration.
        fingerprint: the dataset's fingerprint.
        state_size: values in the model's flat state.
    """
    return {
        "mode": config.mode,
        "model": config.model,
        "fingerprint": fingerprint,
        "state_size": state_size,
        "seed": config.seed,
        "global_batch": config.global_batch,
        "optimizer": config.optimizer,
    }


class Checkpointer:
    """Writes a run's checkpoints, one at a time, gathered at one version.

    Args:
        context: the run (its directory, where checkpoints go under ``checkpoints``: a run
            without one never checkpoints; how long writing one may take; its record; the run
            log for ``checkpoint`` and ``checkpoint_failed`` events and its clock).
        books: the epoch ledgers, each worker's counters, the mode policy's counters, and
            the updater, whose lock keeps updates out while the state is gathered.
        identity: what a resuming server must match (``identity_of``).
        stores: where the state and optimizer slots are gathered from.
    """

    def __init__(
        self,
        context: RunContext,
        books: RunBooks,
        *,
        identity: dict[str, Any],
        stores: ParameterStores,
    ) -> None:
        run_dir = context.config.run_dir
        self.directory = run_dir / "checkpoints" if run_dir is not None else None
        self.write_timeout_s, self.identity = context.config.write_timeout_s, identity
        self.updater, self.stores, self.sampler = books.updater, stores, books.sampler
        self.run, self.roster, self.policy = context.run, books.roster, books.policy
        self.log = context.log
        self._lock = asyncio.Lock()

    async def save(self) -> bool:
        """Write a checkpoint now (one at a time); a failure is logged and training goes on.

        Returns:
            Whether it was written.
        """
        async with self._lock:
            try:
                await self._save()
                return True
            except (OSError, PSError) as exc:
                log.error("checkpoint failed: %s", exc)
                self.log.event("checkpoint_failed", error=str(exc)[:300])
                return False

    async def _save(self) -> Path:
        """Gather the run at one version and write it.

        Raises:
            OSError: it could not be written (``WriteTimeout``: not within ``--write-timeout``).
            ShardLost: a shard did not hand over its state.
        """
        assert self.directory is not None
        directory = self.directory
        begin = time.perf_counter()
        async with self.updater.lock:  # no update is being published: state and books agree
            captured = await self.stores.capture(with_slots=True)
            sampler_arrays, sampler_meta = capture_sampler(self.sampler)
            meta = {
                "version": captured.version,
                "steps": self.updater.steps,
                "samples_applied": self.updater.samples_applied,
                "optimizer_steps": captured.optimizer_steps,
                "slots": captured.slots,
                **self.identity,
                "sampler": sampler_meta,
                "t": self.log.now(),
                **self.run.to_meta(),
                "workers": {str(w["name"]): w for w in self.roster.summaries()},
                "policy": self.policy.state(),
            }
        arrays = {
            "state": captured.state,
            "slots": captured.slot_state.astype(np.float32),
            "torch_rng": torch.get_rng_state().numpy().copy(),
            **sampler_arrays,
        }
        self.log.flush()  # every update it holds is on disk before it is
        what = f"the checkpoint of version {captured.version}"
        saved = Checkpoint(arrays, meta)
        path = await run_bounded(lambda: write(directory, saved), self.write_timeout_s, what)
        self.log.event(
            "checkpoint",
            version=captured.version,
            path=str(path),
            write_s=round(time.perf_counter() - begin, 4),
        )
        log.info("checkpoint of version %d written to %s", captured.version, path)
        return path


def check_identity(meta: dict[str, Any], identity: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``meta`` differs from ``identity`` in a key both have.

    Raises:
        ConfigError: naming each option that differs.
    """
    differs = {k: (meta.get(k), v) for k, v in identity.items() if k in meta and meta[k] != v}
    if differs:
        raise ConfigError(
            "the checkpoint does not match this run's arguments: "
            + ", ".join(
                f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in differs.items()
            )
        )


class BestCheckpoint:
    """Keeps ``best.npz``: the state whose evaluation on the whole test split scored the best
    OA so far (subset scores never count), for ``pserver export --best``.

    Args:
        directory: the run's ``checkpoints`` folder.
        identity: the run's ``identity_of`` (stored with the state).
        write_timeout_s: how long one write may take.
        resumed: a resumed run starts from the OA recorded in the file there.
    """

    def __init__(
        self, directory: Path, identity: dict[str, Any], *, write_timeout_s: float, resumed: bool
    ) -> None:
        self.path, self.identity, self.write_timeout_s = directory / BEST, identity, write_timeout_s
        self.oa = -1.0
        if resumed and self.path.is_file():
            try:
                self.oa = float(read(self.path).meta["oa"])
            except (ConfigError, KeyError, TypeError, ValueError) as exc:
                log.warning("the best checkpoint will be replaced: %s", exc)

    async def offer(self, version: int, state: np.ndarray, oa: float) -> None:
        """Write ``state`` of ``version`` if ``oa`` beats the best so far; a failure is logged."""
        if oa <= self.oa:
            return
        best = Checkpoint({"state": state}, {**self.identity, "version": version, "oa": oa})
        try:
            write = lambda: _write_npz(self.path, best)  # noqa: E731
            await run_bounded(write, self.write_timeout_s, f"the best checkpoint ({version})")
        except OSError as exc:
            log.error("best checkpoint not written: %s", exc)
            return
        self.oa = oa
        log.info("best OA so far on the whole test split (%.4f): version %d kept", oa, version)


def check_contents(checkpoint: Checkpoint, num_samples: int) -> None:
    """Refuse a checkpoint whose numbers cannot be a run's: parameters or optimizer state
    that are not finite, counters that are not counts, sampler books of another size.

    Args:
        checkpoint: what was read.
        num_samples: the size of this run's training split.

    Raises:
        ConfigError: naming the first problem.
    """
    problem = _damage(checkpoint.meta, checkpoint.arrays, num_samples)
    if problem:
        raise ConfigError(f"the checkpoint is damaged: {problem}")


def _damage(meta: dict[str, Any], arrays: dict[str, np.ndarray], num_samples: int) -> str:
    """The first reason the contents cannot be a run's ("" if none)."""
    for name in ("state", "slots"):
        values = arrays.get(name)
        if values is not None and not (
            np.issubdtype(values.dtype, np.floating) and np.isfinite(values).all()
        ):
            return f"{name!r} holds values that are not finite numbers"
    for key in ("version", "steps", "samples_applied", "optimizer_steps"):
        if not _count(meta.get(key)):
            return f"{key!r} is {meta.get(key)!r}, not a count"
    books = meta.get("sampler")
    if not isinstance(books, dict) or not isinstance(books.get("applied"), dict):
        return "the sampler's books are missing"
    if not (_count(books.get("epoch")) and _count(books.get("cursor"))):
        return "the sampler's epoch or cursor is not a count"
    if books["cursor"] > num_samples:
        return f"the sampler's cursor is beyond {num_samples} samples"
    for epoch, applied in books["applied"].items():
        uses = arrays.get(f"uses/{epoch}")
        if (
            not _count(applied)
            or uses is None
            or uses.shape != (num_samples,)
            or not np.issubdtype(uses.dtype, np.integer)
            or (uses < 0).any()
        ):
            return f"the ledger of epoch {epoch!r} does not fit {num_samples} samples"
    return ""


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def restore(
    checkpoint: Checkpoint,
    identity: dict[str, Any],
    sampler: EpochSampler,
    run: RunState,
    roster: Roster,
    policy: ModePolicy,
    log_to: RunLog,
) -> CapturedState:
    """Restore a run's books from ``checkpoint``; returns the state for its stores.

    Args:
        checkpoint: what was read.
        identity: this server's ``identity_of`` (the checkpoint must match it).
        sampler, run, roster, policy: the books to restore.
        log_to: the run log (a ``resume`` event).

    Raises:
        ConfigError: the checkpoint belongs to another mode, model, dataset or seed, holds
            another number of parameters, or its contents are damaged (``check_contents``).
    """
    meta = checkpoint.meta
    check_identity(meta, identity)
    state = checkpoint.arrays.get("state", np.zeros(0)).astype(np.float32)
    if state.size != identity["state_size"]:
        raise ConfigError(
            f"the checkpoint holds {state.size} values, this model {identity['state_size']}"
        )
    check_contents(checkpoint, sampler.num_samples)
    try:
        requeued = restore_sampler(sampler, checkpoint.arrays, meta["sampler"])
        torch.set_rng_state(torch.from_numpy(checkpoint.arrays["torch_rng"].astype(np.uint8)))
        run.load_meta(meta)
        roster.restore_history(meta["workers"])
        policy.restore(meta["policy"])
        samples = int(meta["samples_applied"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        raise ConfigError(f"the checkpoint is damaged: {type(exc).__name__}: {exc}") from exc
    log_to.event("resume", version=checkpoint.version, samples=samples, requeued=requeued)
    log.info(
        "resumed at version %d (epoch %d); %d samples of open epochs to redo",
        checkpoint.version,
        meta["sampler"]["epoch"],
        requeued,
    )
    return CapturedState(
        checkpoint.version,
        int(meta["optimizer_steps"]),
        list(meta.get("slots", [])),
        state,
        checkpoint.arrays.get("slots", np.zeros((0, 0), dtype=np.float32)),
    )
