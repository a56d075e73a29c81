"""Reusable state buffers with explicit leases.

Published snapshots are sent zero-copy (ZeroMQ keeps reading a frame until it is on the wire)
and evaluated or checkpointed on other threads, so a buffer may be reused only when every
holder let go of it: the owner (while it is the published or candidate state), every reader
that took a lease, and every send whose ZeroMQ tracker is not done yet. Fresh 47 MB
allocations cost more than an optimizer step (page faults on first touch), hence the reuse.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class Tracker(Protocol):
    """What the pool needs of ``zmq.MessageTracker``."""

    @property
    def done(self) -> bool:
        """The tracked message left ZeroMQ's hands."""


class Lease:
    """Who still holds one buffer: explicit holds plus pending sends."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._holds = 1
        self._trackers: list[Tracker] = []

    def hold(self) -> Lease:
        """Take one more hold (release it with ``release``)."""
        with self._lock:
            self._holds += 1
        return self

    def release(self) -> None:
        """Drop one hold."""
        with self._lock:
            if self._holds <= 0:
                raise RuntimeError("lease released more often than held")
            self._holds -= 1

    def track(self, tracker: Tracker) -> None:
        """Keep the buffer until ``tracker`` is done (a zero-copy send)."""
        with self._lock:
            self._trackers.append(tracker)

    def free(self) -> bool:
        """Nobody holds the buffer any more."""
        with self._lock:
            self._trackers = [t for t in self._trackers if not t.done]
            return self._holds == 0 and not self._trackers


class BufferPool:
    """Float32 buffers of one size, handed out with a lease.

    Args:
        numel: values per buffer.
        keep: how many buffers the pool keeps for reuse.
    """

    def __init__(self, numel: int, keep: int = 4) -> None:
        self.numel, self.keep = numel, keep
        self._lock = threading.Lock()
        self._entries: list[tuple[torch.Tensor, Lease]] = []

    def acquire(self) -> tuple[torch.Tensor, Lease]:
        """A buffer nobody holds, with a fresh lease held once by the caller."""
        for i, (buf, lease) in enumerate(self._entries):
            if lease.free():
                fresh = Lease(self._lock)
                self._entries[i] = (buf, fresh)
                return buf, fresh
        return self.adopt(torch.empty(self.numel))

    def adopt(self, buf: torch.Tensor) -> tuple[torch.Tensor, Lease]:
        """Manage an existing buffer; returns it with a lease held once by the caller."""
        lease = Lease(self._lock)
        if len(self._entries) < self.keep:
            self._entries.append((buf, lease))
        return buf, lease
