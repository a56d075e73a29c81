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

import dataclasses
import json
import logging
import re
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.errors import ConfigError
from common.safefile import run_bounded, write_atomic
from pserver.sampler import EpochLedger, EpochSampler
from pserver.store.stores import CapturedState

if TYPE_CHECKING:
    from pserver.server import ParameterServer

log = logging.getLogger(__name__)

FORMAT = 2
READABLE_FORMATS = (1, 2)
KEEP = 3
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


def write(directory: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` atomically as ``ckpt-<version>.npz``; keep the newest few.

    Returns:
        The path written.

    Raises:
        OSError: the file could not be written (no temporary file is left behind).
    """
    directory.mkdir(parents=True, exist_ok=True)
    document = json.dumps({"format": FORMAT, **checkpoint.meta}).encode()
    arrays = {"meta": np.frombuffer(document, dtype=np.uint8), **checkpoint.arrays}
    path = write_atomic(
        directory / f"ckpt-{checkpoint.version:010d}.npz",
        lambda handle: np.savez(handle, **arrays),  # type: ignore[arg-type]  # stub: **kwds bool
        sync=True,
    )
    for old in sorted(p for p in directory.iterdir() if NAME.match(p.name))[:-KEEP]:
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


def latest(directory: Path) -> Path | None:
    """The newest checkpoint in ``directory``, or None."""
    if not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if NAME.match(p.name))
    return found[-1] if found else None


def read(path: Path) -> Checkpoint:
    """Load a checkpoint written by ``write`` (this format or the first one).

    Raises:
        ConfigError: the file is damaged or not a checkpoint of a known format.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (OSError, ValueError, KeyError, EOFError, MemoryError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"checkpoint {str(path)!r} has an unknown format")
    if meta["format"] == 1:  # optimizer tensors as opt/<name>
        names = sorted(k.removeprefix("opt/") for k in arrays if k.startswith("opt/"))
        rows = [arrays.pop(f"opt/{n}").astype(np.float32) for n in names]
        arrays["slots"] = np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)
        meta["slots"] = names
    return Checkpoint(arrays, meta)


def read_newest(directory: Path) -> Checkpoint:
    """The newest readable checkpoint; a damaged newer one is skipped with a warning.

    Raises:
        ConfigError: there is none.
    """
    found = (
        sorted((p for p in directory.iterdir() if NAME.match(p.name)), reverse=True)
        if (directory.is_dir())
        else []
    )
    for path in found:
        try:
            return read(path)
        except ConfigError as exc:
            log.warning("%s; trying the previous checkpoint", exc)
    raise ConfigError(f"--resume: no readable checkpoint in {directory}")


def torch_rng() -> np.ndarray:
    """torch's CPU random-number state as bytes."""
    return torch.get_rng_state().numpy().copy()


def set_torch_rng(state: np.ndarray) -> None:
    """Restore torch's CPU random-number state."""
    torch.set_rng_state(torch.from_numpy(state.astype(np.uint8)))


# --- server integration ------------------------------------------------------------------------


def identity_of(ps: ParameterServer) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed by a server."""
    cfg = ps.config
    return {
        "mode": cfg.mode,
        "model": cfg.model,
        "fingerprint": ps.meta.fingerprint,
        "state_size": ps.state_size,
        "seed": cfg.seed,
        "global_batch": cfg.global_batch,
        "optimizer": cfg.optimizer,
    }


async def save(ps: ParameterServer) -> Path:
    """Gather the run at one version and write it to ``run_dir/checkpoints``.

    Returns:
        The checkpoint's path.

    Raises:
        OSError: it could not be written (``WriteTimeout``: not within ``--write-timeout``).
        ShardLost: a shard did not hand over its state.
    """
    assert ps.config.run_dir is not None
    begin = time.perf_counter()
    async with ps.updater.lock:  # no update is being published: state and books agree
        captured = await ps.stores.capture(with_slots=True)
        sampler_arrays, sampler_meta = capture_sampler(ps.sampler)
        meta = {
            "version": captured.version,
            "steps": ps.updater.steps,
            "samples_applied": ps.updater.samples_applied,
            "optimizer_steps": captured.optimizer_steps,
            "slots": captured.slots,
            **identity_of(ps),
            "sampler": sampler_meta,
            "t": ps.log.now(),
            **ps.run.to_meta(),
            "workers": {str(w["name"]): w for w in ps.roster.summaries()},
            "policy": ps.policy.state(),
        }
    arrays = {
        "state": captured.state,
        "slots": captured.slot_state.astype(np.float32),
        "torch_rng": torch_rng(),
        **sampler_arrays,
    }
    directory = ps.config.run_dir / "checkpoints"
    what = f"the checkpoint of version {captured.version}"
    saved = Checkpoint(arrays, meta)
    path = await run_bounded(lambda: write(directory, saved), ps.config.write_timeout_s, what)
    ps.log.event(
        "checkpoint",
        version=captured.version,
        path=str(path),
        write_s=round(time.perf_counter() - begin, 4),
    )
    log.info("checkpoint of version %d written to %s", captured.version, path)
    return path


def restore_into(ps: ParameterServer, checkpoint: Checkpoint) -> CapturedState:
    """Restore a server's books from ``checkpoint``; returns the state for its stores.

    Raises:
        ConfigError: the checkpoint belongs to another mode, model, dataset or seed.
    """
    meta = checkpoint.meta
    mine = identity_of(ps)
    differs = {k: (meta.get(k), v) for k, v in mine.items() if k in meta and meta[k] != v}
    if differs:
        raise ConfigError(
            "the checkpoint does not match this server's arguments: "
            + ", ".join(
                f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in differs.items()
            )
        )
    state = checkpoint.arrays["state"].astype(np.float32)
    if state.size != ps.state_size:
        raise ConfigError(f"the checkpoint holds {state.size} values, this model {ps.state_size}")
    requeued = restore_sampler(ps.sampler, checkpoint.arrays, meta["sampler"])
    set_torch_rng(checkpoint.arrays["torch_rng"])
    ps.run.load_meta(meta)
    ps.roster.history = {str(k): dict(v) for k, v in meta["workers"].items()}
    ps.policy.restore(meta["policy"])
    ps.log.event("resume", version=checkpoint.version, requeued=requeued)
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
