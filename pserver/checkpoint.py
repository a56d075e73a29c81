"""Atomic checkpoints of the training state, and restoring a server from the newest one.

A checkpoint is one ``.npz`` file (no pickle: numeric arrays plus a JSON document stored as
bytes) written to a temporary name and renamed, so a crash never leaves a torn file. It holds
the parameters and float buffers, the optimizer state, the version and step counters, the
epoch and which samples of each open epoch were applied, the random-number state, the
evaluations so far and each worker's counters. Samples that were handed out but not applied
are handed out again after a restore, so each epoch still uses every sample exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ConfigError
from pserver.sampler import EpochLedger, EpochSampler

log = logging.getLogger(__name__)

FORMAT = 1
KEEP = 3
NAME = re.compile(r"^ckpt-(\d{10})\.npz$")


@dataclasses.dataclass
class Checkpoint:
    """Everything a server needs to continue a run.

    Attributes:
        arrays: ``state``, ``opt/<name>`` optimizer tensors, ``uses/<epoch>`` ledgers,
            ``torch_rng``.
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
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{checkpoint.version:010d}.npz"
    tmp = directory / f".{path.name}.tmp"
    document = json.dumps({"format": FORMAT, **checkpoint.meta}).encode()
    with tmp.open("wb") as handle:
        np.savez(handle, meta=np.frombuffer(document, dtype=np.uint8), **checkpoint.arrays)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    for old in sorted(p for p in directory.iterdir() if NAME.match(p.name))[:-KEEP]:
        old.unlink()
    return path


def latest(directory: Path) -> Path | None:
    """The newest checkpoint in ``directory``, or None."""
    if not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if NAME.match(p.name))
    return found[-1] if found else None


def read(path: Path) -> Checkpoint:
    """Load a checkpoint written by ``write``.

    Raises:
        ConfigError: the file is not a checkpoint of this format.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    if meta.get("format") != FORMAT:
        raise ConfigError(
            f"checkpoint {str(path)!r} has format {meta.get('format')!r}, expected {FORMAT}"
        )
    return Checkpoint(arrays, meta)


def torch_rng() -> np.ndarray:
    """torch's CPU random-number state as bytes."""
    return torch.get_rng_state().numpy().copy()


def set_torch_rng(state: np.ndarray) -> None:
    """Restore torch's CPU random-number state."""
    torch.set_rng_state(torch.from_numpy(state.astype(np.uint8)))


# --- server integration ------------------------------------------------------------------------
# These functions read and set ParameterServer attributes; they live here so that the server
# module keeps to serving.


def identity_of(ps: Any) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed by a server."""
    return {
        "mode": ps.config.mode,
        "model": ps.config.model,
        "fingerprint": ps.meta.fingerprint,
        "state_size": ps.trainer.state_size,
    }


async def save(ps: Any) -> Path:
    """Write a checkpoint of server ``ps`` to ``run_dir/checkpoints`` and log it.

    Returns:
        The checkpoint's path.
    """
    import asyncio
    import time

    begin = time.perf_counter()
    arrays, counters = await ps.trainer.capture()
    # No await between here and the capture's completion: the ledgers match the state.
    sampler_arrays, sampler_meta = capture_sampler(ps.trainer.sampler)
    arrays.update(sampler_arrays)
    arrays["torch_rng"] = torch_rng()
    meta = {
        **counters,
        **identity_of(ps),
        "sampler": sampler_meta,
        "t": ps.log.now(),
        "train_start": ps.train_start,
        "time_to_target": ps.time_to_target,
        "epochs_done": ps.epochs_done,
        "evals": ps.evals,
        "workers": {w.name: w.summary() for w in ps.roster.all_workers()},
        "policy": ps.policy.state(),
    }
    directory = ps.config.run_dir / "checkpoints"
    loop = asyncio.get_running_loop()
    path = await loop.run_in_executor(None, write, directory, Checkpoint(arrays, meta))
    ps.log.event(
        "checkpoint",
        version=counters["version"],
        path=str(path),
        write_s=round(time.perf_counter() - begin, 4),
    )
    log.info("checkpoint of version %d written to %s", counters["version"], path)
    return path


def load(ps: Any, checkpoint: Checkpoint) -> None:
    """Restore server ``ps`` (built with the same arguments) from ``checkpoint``.

    Raises:
        ConfigError: the checkpoint belongs to another mode, model or dataset.
    """
    meta = checkpoint.meta
    mine = identity_of(ps)
    differs = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v}
    if differs:
        raise ConfigError(
            "the checkpoint does not match this server's arguments: "
            + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in differs.items())
        )
    ps.trainer.restore(checkpoint.arrays, meta)
    requeued = restore_sampler(ps.trainer.sampler, checkpoint.arrays, meta["sampler"])
    set_torch_rng(checkpoint.arrays["torch_rng"])
    ps.train_start = meta["train_start"]
    ps.time_to_target = meta["time_to_target"]
    ps.epochs_done = meta["epochs_done"]
    ps.evals = list(meta["evals"])
    ps.roster.history = dict(meta["workers"])
    ps.policy.restore(meta["policy"])
    ps.log.event("resume", version=checkpoint.version, requeued=requeued)
    log.info(
        "resumed at version %d (epoch %d); %d samples of open epochs to redo",
        checkpoint.version,
        meta["sampler"]["epoch"],
        requeued,
    )
