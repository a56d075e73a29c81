"""The coordinator's view of where parameters live: its own ``StoreService`` (``--shards 1``), or
K shard servers (``RemoteStores``). Both offer the same operations (``ParameterStores``), so the
push path does not care which.

With shards every operation fans out to all of them at once and completes when all answered.
An update is published in two phases: every shard computes and validates its candidate
(``prepare``), and only when all of them succeeded does any shard ``publish`` it; otherwise all
``abort`` it. So no version is ever half applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import numpy as np

from common.errors import ErrorCode, NetworkTimeout, ProtocolError, RemoteError, ShardLost
from common.protocol.aclient import AsyncConnection
from common.protocol.messages import (
    GradientChunk,
    GradientPushRequest,
    Message,
    PullRequest,
)
from common.protocol.shard_messages import (
    AbortRequest,
    AckReply,
    CaptureRequest,
    DropRequest,
    PingReply,
    PingRequest,
    PrepareReply,
    PrepareRequest,
    PublishRequest,
    ShutdownRequest,
    StagedReply,
    StagedRequest,
    StateReply,
)
from pserver.store.service import CapturedState, StageReport, StoreService, error_code

__all__ = ["CapturedState", "ParameterStores", "RemoteStores", "ShardLink"]

_M = TypeVar("_M", bound=Message)
SHUTDOWN_S = 2.0  # how long a shard may take to acknowledge the end of the run


@dataclasses.dataclass
class ShardLink:
    """The coordinator's connection to one shard server."""

    index: int
    address: str
    lo: int
    hi: int
    connection: AsyncConnection

    def describe(self) -> str:
        """How errors name this shard."""
        return f"shard {self.index} at {self.address} (state [{self.lo}, {self.hi}))"


class RemoteStores:
    """K shard servers, each holding one contiguous range of the state; ``StoreService``'s
    operations, each sent to every shard.

    Args:
        bounds: K + 1 range boundaries.
        key: the shard key control requests carry.
        timeout_s: how long a shard may take to answer a control request.
        num_params: the parameters at the start of the state (the optimizer slots cover them).
        slots: the optimizer's slot names.
    """

    def __init__(
        self,
        bounds: list[int],
        key: str,
        *,
        timeout_s: float,
        num_params: int,
        slots: Sequence[str],
    ) -> None:
        self.bounds = bounds
        self.key = key
        self.timeout_s = timeout_s
        self.num_params = num_params
        self.slots = list(slots)
        self.links: list[ShardLink] = []
        self.ready = asyncio.Event()
        self.health: dict[int, dict[str, Any]] = {}

    @property
    def addresses(self) -> list[str]:
        """Where workers reach each shard, in range order."""
        return [link.address for link in self.links]

    @property
    def expected(self) -> int:
        """How many shards the run needs."""
        return len(self.bounds) - 1

    def add(self, link: ShardLink) -> None:
        """A shard registered; the stores are ready once all have."""
        self.links.append(link)
        self.links.sort(key=lambda s: s.index)
        if len(self.links) == self.expected:
            self.ready.set()

    async def _ask(
        self, request: Message, expect: type[_M], timeout_s: float | None = None
    ) -> list[_M]:
        """Send ``request`` to every shard at once; their replies in range order."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        results = await asyncio.gather(
            *(s.connection.request(request, limit, expect) for s in self.links),
            return_exceptions=True,
        )
        what = request.TYPE.removesuffix("_request")
        for link, result in zip(self.links, results, strict=True):
            if isinstance(result, NetworkTimeout):
                raise ShardLost(f"{link.describe()} did not answer {what}: {result}")
            if isinstance(result, RemoteError):
                raise ProtocolError(
                    error_code(result.code), f"{link.describe()}: {result.remote_message}"
                )
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    async def staged(self, task_id: int, worker_id: int, timeout_s: float) -> StageReport:
        request = StagedRequest(
            key=self.key, task_id=task_id, worker_id=worker_id, timeout_s=timeout_s
        )
        replies = await self._ask(request, StagedReply, timeout_s + self.timeout_s)
        return StageReport(
            all(r.finite for r in replies),
            sum(r.grad_sq for r in replies),
            sum(r.buffer_sq for r in replies),
        )

    async def prepare(
        self,
        version: int,
        task_ids: list[int],
        weights: list[float],
        lr_scale: float,
        buffer_scale: float,
    ) -> tuple[bool, str]:
        request = PrepareRequest(
            key=self.key,
            version=version,
            task_ids=task_ids,
            weights=weights,
            lr_scale=lr_scale,
            buffer_scale=buffer_scale,
        )
        replies = await self._ask(request, PrepareReply)
        failed = [(s, r) for s, r in zip(self.links, replies, strict=True) if not r.ok]
        if failed:
            link, reply = failed[0]
            return False, f"{reply.reason} ({link.describe()})"
        return True, ""

    async def publish(self, version: int) -> None:
        request = PublishRequest(key=self.key, version=version)
        await self._ask(request, AckReply)

    async def abort(self, version: int, code: int, message: str) -> None:
        request = AbortRequest(key=self.key, version=version, code=code, message=message)
        await self._ask(request, AckReply)

    async def drop(self, task_ids: list[int], code: int, message: str) -> None:
        request = DropRequest(key=self.key, task_ids=task_ids, code=code, message=message)
        await self._ask(request, AckReply)

    async def capture(self, with_slots: bool) -> CapturedState:
        request = CaptureRequest(key=self.key, with_slots=with_slots)
        replies = await self._ask(request, StateReply, self.timeout_s * 4)
        for link, reply in zip(self.links, replies, strict=True):
            self._check_state(link, reply, with_slots)
        versions = {r.version for r in replies}
        if len(versions) != 1:
            raise ShardLost(f"shards are at different versions {sorted(versions)}")
        steps = {r.optimizer_steps for r in replies}
        if len(steps) != 1:
            raise ShardLost(f"shards are at different optimizer steps {sorted(steps)}")
        state = np.concatenate([r.state for r in replies])
        slots = replies[0].slots
        rows = (
            np.concatenate([r.slot_state.reshape(len(slots), -1) for r in replies], axis=1)
            if slots
            else np.zeros((0, 0), dtype=np.float32)
        )
        return CapturedState(
            replies[0].version, replies[0].optimizer_steps, list(slots), state, rows
        )

    async def newest_state(self) -> tuple[int, np.ndarray, Callable[[], None]]:
        captured = await self.capture(with_slots=False)
        return captured.version, captured.state, lambda: None

    def _check_state(self, link: ShardLink, reply: StateReply, with_slots: bool) -> None:
        """Refuse a state slice that is not what ``link`` holds, as a push would be refused:
        float32, its range's length, finite, with this optimizer's slots over its parameters.

        Raises:
            ProtocolError: BAD_TENSOR, BAD_FIELD or NON_FINITE, naming the shard.
        """
        split = min(max(self.num_params - link.lo, 0), link.hi - link.lo)
        slots = self.slots if with_slots else []
        problems = [
            (
                reply.state.dtype != np.float32 or reply.state.shape != (link.hi - link.lo,),
                ErrorCode.BAD_TENSOR,
                f"a state of {reply.state.dtype} {reply.state.shape}, not float32 "
                f"({link.hi - link.lo},)",
            ),
            (list(reply.slots) != slots, ErrorCode.BAD_FIELD, f"slots {reply.slots[:4]}"),
            (
                reply.slot_state.dtype != np.float32
                or reply.slot_state.shape != (len(slots) * split,),
                ErrorCode.BAD_TENSOR,
                f"optimizer slots of {reply.slot_state.dtype} {reply.slot_state.shape}, not "
                f"float32 ({len(slots) * split},)",
            ),
            (
                reply.version < 0 or reply.optimizer_steps < 0,
                ErrorCode.BAD_FIELD,
                "a negative count",
            ),
        ]
        for bad, code, what in problems:
            if bad:
                raise ProtocolError(code, f"{link.describe()} handed back {what}")
        if not (np.isfinite(reply.state).all() and np.isfinite(reply.slot_state).all()):
            raise ProtocolError(
                ErrorCode.NON_FINITE, f"{link.describe()} handed back a state that is not finite"
            )

    async def ping(self) -> list[int]:
        """Every shard's version (raises ``ShardLost`` naming a shard that did not answer)."""
        request = PingRequest(key=self.key)
        begin = time.monotonic()
        replies = await self._ask(request, PingReply)
        rtt = time.monotonic() - begin
        for link, reply in zip(self.links, replies, strict=True):
            self.health[link.index] = {
                "version": reply.version,
                "staged": reply.staged,
                "ping_s": round(rtt, 4),
                "at": time.time(),
            }
        return [r.version for r in replies]

    async def wait_ready(self) -> None:
        if self.ready.is_set():
            return
        try:
            await asyncio.wait_for(self.ready.wait(), self.timeout_s)
        except TimeoutError:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"waiting for {self.expected - len(self.links)} of {self.expected} parameter "
                "shards to register; try again",
            ) from None

    fused_params = None  # a push's reply cannot carry parameters that live on K shards

    async def on_gradient_chunk(self, identity: bytes, request_id: int, msg: GradientChunk) -> None:
        _on_shards(msg)

    async def on_gradient_push(self, msg: GradientPushRequest) -> None:
        _on_shards(msg)

    async def on_pull(self, identity: bytes, request_id: int, msg: PullRequest) -> None:
        _on_shards(msg)

    async def close(self, reason: str) -> None:
        request = ShutdownRequest(key=self.key, reason=reason[:200])
        await asyncio.gather(
            *(s.connection.request(request, SHUTDOWN_S, AckReply) for s in self.links),
            return_exceptions=True,
        )
        for link in self.links:
            await link.connection.close()


def _on_shards(msg: Message) -> None:
    raise ProtocolError(
        ErrorCode.BAD_FIELD, f"{msg.TYPE}: this run's parameters live on its shards"
    )


ParameterStores: TypeAlias = StoreService | RemoteStores
"""Wherever the coordinator's parameters live."""
