"""The ingress half of the token channels (cluster/channel_inbox.py) against the real engine half (ChannelHost),
with Serve's transport replaced by direct async iteration: chunks in order over a shared channel, the request's own
stream's error reaching its consumer, and a channel that ends failing the requests routed through it."""

from __future__ import annotations

import asyncio

import pytest

from cluster.channel_inbox import ChannelInbox
from cluster.engine_channel import ChannelHost, ChannelRoute
from cp_router.protocol import EngineChunk, EngineOverloadedError, EngineUnavailableError


class Stream:
    """What a streaming DeploymentHandle call returns, over a local async generator."""

    def __init__(self, items):
        self.items = items

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self) -> None:
        asyncio.get_running_loop().create_task(self.items.aclose())


class Method:
    def __init__(self, call):
        self.call = call

    def remote(self, *args, **kwargs) -> Stream:
        return Stream(self.call(*args, **kwargs))


class StreamHandle:
    """`handle.options(stream=True)` of one engine replica: its `channel` is the ChannelHost's."""

    def __init__(self, host: ChannelHost):
        self.channel = Method(host.channel)


def chunks_of(count: int, delay_s: float = 0.0, error: BaseException | None = None):
    async def chunks():
        for token in range(1, count + 1):
            await asyncio.sleep(delay_s)
            yield EngineChunk((token,), str(token), "length" if token == count else None, 2, token)
        if error is not None:
            raise error
    return chunks()


async def open_inbox(host: ChannelHost) -> ChannelInbox:
    inbox = ChannelInbox(StreamHandle(host))
    inbox.ensure(host.replica_id)
    while inbox.ingress_id not in host.outboxes:
        await asyncio.sleep(0.001)
    return inbox


async def send(inbox: ChannelInbox, host: ChannelHost, request_id: str, chunks) -> list[EngineChunk]:
    """What ServeEngineClient._one_attempt does with a request the engine routed through the channel."""
    inbox.subscribe(request_id)
    response = Stream(host.generate(chunks, request_id, inbox.ingress_id))
    route = await response.__anext__()
    assert route == ChannelRoute(host.replica_id, True)
    try:
        return [chunk async for chunk in inbox.chunks(request_id, route.replica_id, response)]
    finally:
        inbox.unsubscribe(request_id)


def test_concurrent_requests_get_their_own_chunks_in_order_over_one_channel():
    async def run():
        host = ChannelHost("replica-a")
        inbox = await open_inbox(host)
        results = await asyncio.gather(*[send(inbox, host, f"r{i}", chunks_of(4 + i, 0.001)) for i in range(6)])
        return results, host.outboxes[inbox.ingress_id].users

    results, users = asyncio.run(run())
    assert [[chunk.token_ids[0] for chunk in result] for result in results] == [list(range(1, 5 + i)) for i in range(6)]
    assert all(result[-1].finish_reason == "length" for result in results) and users == 0


def test_an_error_on_the_requests_own_stream_reaches_its_consumer():
    async def run():
        host = ChannelHost("replica-a")
        inbox = await open_inbox(host)

        async def overloaded():
            raise EngineOverloadedError("engine queue full (1 waiting requests)", 1.0)
            yield  # an async generator

        return await send(inbox, host, "r1", overloaded())

    with pytest.raises(EngineOverloadedError, match="engine queue full"):
        asyncio.run(run())


def test_a_channel_that_ends_fails_the_requests_routed_through_it():
    async def run():
        host = ChannelHost("replica-a")
        inbox = await open_inbox(host)
        pending = asyncio.create_task(send(inbox, host, "r1", chunks_of(100, 0.01)))
        while "r1" not in inbox.routes:
            await asyncio.sleep(0.001)
        host.outboxes[inbox.ingress_id].close()  # the engine side of the channel goes away mid-request
        return await pending

    with pytest.raises(EngineUnavailableError, match="channel"):
        asyncio.run(run())
