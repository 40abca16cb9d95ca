"""Engine replica -> ingress replica token channels (separate placement): one Ray stream per pair, not per request.

A streamed item costs about 0.6 ms of CPU between two processes on the 2-core bench VM over Ray object refs (a
Serve handle stream and a bare actor stream alike) and 0.27 ms over Serve's gRPC
(docs/bench_notes/serving_separate_placement.md has the script). Streamed per request, a 32-stream decode sends one item per request per engine call; through a channel,
one item per call for all the requests of one ingress replica.

* `ChannelHost` (engine side) keeps one `ChannelOutbox` per ingress replica that opened a channel here
  (`DSAEngine.channel`). `DSAEngine.generate(request, ingress_id)` first yields a `ChannelRoute` (which replica
  took the request, and whether its chunks follow on that ingress's channel); with a channel, the chunks go
  into the outbox and the request's own stream ends after its final chunk was queued there. Without one they
  follow on the request's own stream, as before.
* The outbox batches what the step loop pushed in one loop turn: the step pushes every request's chunk
  synchronously, so every request's consumer runs before the channel's own wakeup.
* A channel with no request for `idle_close_s` ends itself: Serve counts an open channel as an ongoing request,
  and a replica Serve stops waits for its ongoing requests (drain_timeout_s). The ingress opens it again on
  demand.
* DSAEngine's request router (`EngineRouter`, cluster/engine_router.py) sends a `channel` call to the replica
  it names. A config that sets its own request_router_config for DSAEngine replaces it: a channel that then
  reaches another replica is refused, and that replica's requests keep streaming on their own streams (slower,
  same tokens).
The ingress side is cluster/channel_inbox.py.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from cp_router.protocol import EngineChunk, EngineUnavailableError

CHANNEL_METHOD = "channel"  # the DSAEngine method EngineRouter routes by its `target_replica` argument
CHANNEL_IDLE_CLOSE_S = 5.0


@dataclass(frozen=True)
class ChannelRoute:
    """The first item of every engine stream: the replica that took the request, and whether its chunks follow
    on the ingress's channel (else on this stream)."""

    replica_id: str
    via_channel: bool


@dataclass(frozen=True)
class ChannelOpened:
    """The first item of a channel stream: the replica at its other end."""

    replica_id: str


class ChannelOutbox:
    """Chunks for one ingress replica, batched per loop turn; `users` counts the requests routed through it."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, EngineChunk]] = []
        self.ready = asyncio.Event()
        self.closed = False
        self.users = 0

    def put(self, request_id: str, chunk: EngineChunk) -> None:
        if self.closed:
            raise EngineUnavailableError("the channel to the ingress replica closed; the request was aborted")
        self.pending.append((request_id, chunk))
        self.ready.set()

    async def batches(self, idle_close_s: float) -> AsyncIterator[list[tuple[str, EngineChunk]]]:
        """Each loop turn's chunks as one list, until closed or idle (no request using it) for idle_close_s."""
        while not self.closed:
            try:
                await asyncio.wait_for(self.ready.wait(), idle_close_s)
            except asyncio.TimeoutError:
                if self.users == 0:
                    return
                continue
            self.ready.clear()
            batch, self.pending = self.pending, []
            if batch:
                yield batch

    def close(self) -> None:
        self.closed = True
        self.ready.set()


class ChannelHost:
    """The engine replica's channels, one per ingress replica, keyed by the ingress's id."""

    def __init__(self, replica_id: str, idle_close_s: float = CHANNEL_IDLE_CLOSE_S):
        self.replica_id, self.idle_close_s = replica_id, idle_close_s
        self.outboxes: dict[str, ChannelOutbox] = {}

    async def channel(self, ingress_id: str, target_replica: str) -> AsyncIterator[object]:
        """The stream of one ingress's channel: `ChannelOpened`, then batches of (request_id, chunk)."""
        if target_replica != self.replica_id:  # routed by EngineRouter; a mismatch would mix up routes
            raise EngineUnavailableError(f"channel for replica {target_replica} reached replica {self.replica_id}")
        previous = self.outboxes.pop(ingress_id, None)
        if previous is not None:
            previous.close()
        outbox = self.outboxes[ingress_id] = ChannelOutbox()
        try:
            yield ChannelOpened(self.replica_id)
            async for batch in outbox.batches(self.idle_close_s):
                yield batch
        finally:
            outbox.close()
            if self.outboxes.get(ingress_id) is outbox:
                del self.outboxes[ingress_id]

    async def generate(self, chunks: AsyncIterator[EngineChunk], request_id: str,
                       ingress_id: str | None) -> AsyncIterator[object]:
        """`ChannelRoute`, then the engine's chunks of request `request_id`: into the ingress's outbox when it has a
        channel here, else on this stream."""
        outbox = self.outboxes.get(ingress_id) if ingress_id is not None else None
        if outbox is None:
            yield ChannelRoute(self.replica_id, False)
            async for chunk in chunks:
                yield chunk
            return
        outbox.users += 1  # before the first yield: the outbox must not close idle under this request
        try:
            yield ChannelRoute(self.replica_id, True)
            async with aclosing(chunks):  # a closed outbox raises here: the engine's stream then aborts
                async for chunk in chunks:
                    outbox.put(request_id, chunk)
        finally:
            outbox.users -= 1

