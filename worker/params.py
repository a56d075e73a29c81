"""The worker's side of the parameter stores: push a gradient and pull parameters, chunk by
chunk, to and from every store at once.

Each store (the coordinator itself with ``--shards 1``, else each shard) gets its own socket.
A push sends every chunk of the gradient without waiting; each chunk is answered with the same
range of the next parameters once the update is published, and those chunks are written into
the host state buffer as they arrive. A pull asks every chunk of the parameters at once.
When the coordinator is the only store and the state is one chunk, the gradient travels inside
the push request and the parameters inside its reply instead (``whole_on_coordinator``).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch
import zmq

from common import stagetrace
from common.errors import ErrorCode, NetworkTimeout, ProtocolError, RemoteError, ServerLost
from common.protocol.base import parse_message
from common.protocol.chunks import as_tensor, chunk_spans, decode_into, encode
from common.protocol.messages import (
    REPLIES,
    GradientChunk,
    JoinReply,
    ParamsChunk,
    PullRequest,
    TaskParamsReply,
)
from common.protocol.security import ClientKeys


class StoreClient:
    """Sockets to every parameter store, with the chunk layout of the state.

    Args:
        context: the worker's ZeroMQ context.
        join: the join reply: one endpoint per store ("" stands for ``coordinator``), the
            ranges (store ``k`` holds state elements ``shard_bounds[k]`` to
            ``shard_bounds[k + 1]``), elements per chunk, the wire format, this worker's id
            and its store token.
        coordinator: the coordinator's endpoint.
        curve: CURVE keys (stores use the coordinator's key pair).
        abort: an ``inproc://`` endpoint whose messages end every wait with ``ServerLost``.
    """

    def __init__(
        self,
        context: zmq.Context,
        join: JoinReply,
        *,
        coordinator: str,
        curve: ClientKeys | None = None,
        abort: str | None = None,
    ) -> None:
        addresses, bounds, chunk_elems = join.shard_addresses, join.shard_bounds, join.chunk_elems
        wire, worker_id, token = join.wire_dtype, join.worker_id, join.store_token
        if (
            len(bounds) != len(addresses) + 1
            or list(bounds) != sorted(bounds)
            or (bounds[0], bounds[-1]) != (0, join.state_size)
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"shard bounds {list(bounds)[:8]} do not cover the state of {join.state_size}",
            )
        self.wire, self.worker_id, self.token = wire, worker_id, token
        self.transfer_s = 0.0
        self._ids = itertools.count(1)
        self._poller = zmq.Poller()
        self._sockets: list[zmq.Socket] = []
        self._spans: list[list[tuple[int, int]]] = []
        for address, lo, hi in zip(addresses, bounds[:-1], bounds[1:], strict=True):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.apply(sock)
            sock.connect(address or coordinator)
            self._poller.register(sock, zmq.POLLIN)
            self._sockets.append(sock)
            self._spans.append(chunk_spans(lo, hi, chunk_elems))
        self._abort: zmq.Socket | None = None
        if abort is not None:
            self._abort = context.socket(zmq.SUB)
            self._abort.setsockopt(zmq.LINGER, 0)
            self._abort.setsockopt(zmq.SUBSCRIBE, b"")
            self._abort.connect(abort)
            self._poller.register(self._abort, zmq.POLLIN)
        self._waiting: dict[int, tuple[int, int]] = {}  # request id -> (start, stop)
        self._chunk_socket = [
            sock for sock, spans in zip(self._sockets, self._spans, strict=True) for _ in spans
        ]
        self._push: tuple[int, str, int] = (0, "", 0)
        self._min_version = 0  # what the answers to the last push or pull may not be older than
        self._unsent: set[int] = set()
        self._chunks = [span for spans in self._spans for span in spans]
        self.whole_on_coordinator = list(addresses) == [""] and len(self._chunks) == 1

    def encode_whole(self, gradient: torch.Tensor) -> tuple[np.ndarray, float]:
        """The whole gradient in the wire format and its scale, to travel inside the push
        (``whole_on_coordinator`` runs only)."""
        return encode(gradient, self.wire)

    def load_whole(self, reply: TaskParamsReply, state: torch.Tensor) -> int:
        """Write the parameters a push's reply carried into ``state``; returns their version.

        Raises:
            ProtocolError: they are not the whole state in the run's wire format.
        """
        span = self._chunks[0]
        self._load(span, span[0], reply.scale, reply.params, state)
        self.transfer_s = 0.0  # they came with the reply, not chunk by chunk
        return reply.params_version

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """Every chunk ``(start, stop)`` of the state, in store order."""
        return list(self._chunks)

    def begin_push(self, task_id: int, push_token: str, version: int) -> None:
        """Start pushing the gradient of ``task_id``: chunks follow with ``send_chunk``."""
        self._waiting.clear()
        self._push = (task_id, push_token, version)
        self._min_version = version + 1  # the answers carry the update the gradient went into
        self._unsent = set(range(len(self._chunk_socket)))

    def send_chunk(self, index: int, values: torch.Tensor) -> None:
        """Send chunk ``index`` (of ``chunks``) of the gradient being pushed; its reply (the
        same range of the next parameters) comes later."""
        task_id, push_token, version = self._push
        start, stop = self._chunks[index]
        data, scale = encode(values, self.wire)
        request_id = next(self._ids)
        message = GradientChunk(
            worker_id=self.worker_id,
            token=push_token,
            task_id=task_id,
            version=version,
            offset=start,
            scale=scale,
            gradient=data,
        )
        self._chunk_socket[index].send_multipart(message.to_wire(request_id), copy=False)
        stagetrace.mark("w_chunk_out", task=task_id, offset=start)
        self._waiting[request_id] = (start, stop)
        self._unsent.discard(index)

    def unsent(self) -> list[int]:
        """Chunks of the push not sent yet."""
        return sorted(self._unsent)

    def push(self, task_id: int, push_token: str, version: int, gradient: torch.Tensor) -> None:
        """Send every chunk of ``gradient`` (flat float32 on the host); replies come later."""
        self.begin_push(task_id, push_token, version)
        for index, (start, stop) in enumerate(self._chunks):
            self.send_chunk(index, gradient[start:stop])

    def pull(self, min_version: int) -> None:
        """Ask every store for every chunk of version ``min_version`` or newer."""
        self._waiting.clear()
        self._min_version = min_version
        for sock, spans in zip(self._sockets, self._spans, strict=True):
            for start, stop in spans:
                request_id = next(self._ids)
                message = PullRequest(
                    worker_id=self.worker_id,
                    token=self.token,
                    min_version=min_version,
                    offset=start,
                    length=stop - start,
                )
                sock.send_multipart(message.to_wire(request_id), copy=False)
                self._waiting[request_id] = (start, stop)

    def collect(self, state: torch.Tensor, timeout_s: float) -> int:
        """Receive the answers to the last push or pull into the host ``state`` buffer.

        Returns:
            The version received (the oldest, should the stores differ).

        Raises:
            RemoteError: a store answered with an error (every answer was still drained).
            ProtocolError: a store answered with something else than the chunk asked for
                (another message, another range or size, parameters older than asked); every
                answer was still drained.
            NetworkTimeout: not every chunk arrived within ``timeout_s``.
            ServerLost: the abort channel fired.
        """
        deadline = time.monotonic() + timeout_s
        versions: list[int] = []
        error: RemoteError | ProtocolError | None = None
        first: float | None = None
        while self._waiting:
            left = deadline - time.monotonic()
            ready = dict(self._poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if self._abort is not None and self._abort in ready:
                raise ServerLost(self._abort.recv().decode(errors="replace"))
            if not ready:
                raise NetworkTimeout(
                    f"{len(self._waiting)} parameter chunks did not arrive within {timeout_s:g} s"
                )
            for sock in self._sockets:
                if sock not in ready:
                    continue
                while sock.poll(0):
                    frames = sock.recv_multipart(copy=False)
                    try:
                        reply, request_id = parse_message(frames, REPLIES)
                    except RemoteError as exc:
                        if self._waiting.pop(exc.request_id, None) is not None and error is None:
                            error = exc
                        continue
                    span = self._waiting.pop(request_id, None)
                    if span is None:
                        continue  # a late answer to an earlier request
                    problem = self._misfit(reply)
                    if problem:
                        error = error or ProtocolError(ErrorCode.BAD_FIELD, problem)
                        continue
                    assert isinstance(reply, ParamsChunk)
                    first = time.monotonic() if first is None else first
                    stagetrace.mark("w_chunk_in", version=reply.version, offset=reply.offset)
                    try:
                        self._load(span, reply.offset, reply.scale, reply.params, state)
                    except ProtocolError as exc:
                        error = error or exc
                        continue
                    versions.append(reply.version)
        self.transfer_s = 0.0 if first is None else time.monotonic() - first
        if error is not None:
            raise error
        return min(versions)

    def _misfit(self, reply: object) -> str:
        """Why ``reply`` cannot answer a chunk of the last push or pull ("" if it can)."""
        if not isinstance(reply, ParamsChunk):
            return f"a store answered a chunk with {getattr(reply, 'TYPE', type(reply).__name__)}"
        if reply.version < self._min_version:
            return f"a store answered version {reply.version}, asked {self._min_version} or newer"
        return ""

    def _load(
        self,
        span: tuple[int, int],
        offset: int,
        scale: float,
        params: np.ndarray,
        state: torch.Tensor,
    ) -> None:
        """Write a received chunk into ``state`` once checked to be ``span`` in the wire format."""
        start, stop = span
        if offset != start:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"chunk at {offset}, asked {start}")
        data = as_tensor(params, self.wire, "params")
        if data.numel() != stop - start or not scale > 0:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"chunk at {start} has the wrong size")
        decode_into(data, scale, state[start:stop])

    def close(self) -> None:
        """Close every socket."""
        for sock in self._sockets:
            sock.close(linger=0)
        if self._abort is not None:
            self._abort.close(linger=0)
