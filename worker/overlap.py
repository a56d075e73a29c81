"""Pushing gradient chunks while backward is still running.

Backward produces gradients from the last layers to the first, i.e. from the end of the flat
state to its start. Each parameter's hook counts down the chunks it overlaps; a chunk is sent
the moment its last parameter's gradient is in, so most of the push is on the wire before
backward ends (as DDP overlaps its all-reduce buckets). Chunks no hook completes (buffer-only
chunks, parameters without gradients) are sent when backward is done.

The hooks send from the thread that runs backward: the worker's own thread on a CPU, the
autograd device thread on a GPU, while the worker's thread waits in ``backward()`` and does
not touch the sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from common.training.flat import FlatModel
from worker.params import StoreClient


class OverlappedPush:
    """Sends each gradient chunk as soon as backward has finished it.

    Args:
        flat: the model in flat buffers.
        stores: the store client (its chunk layout decides what a chunk is).
        host: the flat host buffer the push is staged in.
    """

    def __init__(self, flat: FlatModel, stores: StoreClient, *, host: torch.Tensor) -> None:
        self.flat, self.stores, self.host = flat, stores, host
        self.chunks = stores.chunks
        self._lock = threading.Lock()
        self._armed = False
        self._needed = [0] * len(self.chunks)
        offset = 0
        for param in flat.model.parameters():
            n = param.numel()
            mine = [j for j, (a, b) in enumerate(self.chunks) if a < offset + n and b > offset]
            for j in mine:
                self._needed[j] += 1
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._hook(mine))
            offset += n
        self._left: list[int] = []

    def _hook(self, chunks: list[int]) -> Callable[[torch.Tensor], None]:
        def ready(_param: torch.Tensor) -> None:
            if not self._armed:
                return  # calibration or a step whose push is not overlapped
            with self._lock:
                done = []
                for j in chunks:
                    self._left[j] -= 1
                    if self._left[j] == 0:
                        done.append(j)
            for j in done:
                self._send(j)

        return ready

    def arm(self, task_id: int, push_token: str, version: int) -> None:
        """After the forward pass, before backward: start the push of this task."""
        self.stores.begin_push(task_id, push_token, version)
        self._left = list(self._needed)
        self._armed = True
        for j, left in enumerate(self._left):
            if left == 0:  # buffers only: complete once forward has run
                self._send(j)

    def finish(self) -> None:
        """After backward: send whatever the hooks did not."""
        self._armed = False
        for j in self.stores.unsent():
            self._send(j)

    def cancel(self) -> None:
        """Backward will not run (the loss was not finite): send nothing more."""
        self._armed = False

    def _send(self, j: int) -> None:
        start, stop = self.chunks[j]
        self.flat.push_into(self.host, start, stop)
        self.stores.send_chunk(j, self.host[start:stop])
