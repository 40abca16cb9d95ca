"""The engine half of the engine -> ingress token channels (cluster/engine_channel.py), on plain asyncio: which
stream a request's chunks take, one batch per loop turn, idle close, and a closed channel aborting its requests."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine_channel import ChannelHost, ChannelOpened, ChannelRoute
from cp_router.protocol import EngineChunk, EngineUnavailableError


def chunk(token: int, finish: str | None = None) -> EngineChunk:
    return EngineChunk((token,), f"t{token}", finish, 3, token)


class ScriptedStream:
    """An engine stream fed by the test: `push` plays the step loop; `aborted` tells whether it was closed early."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[EngineChunk] = asyncio.Queue()
        self.aborted = False

    def push(self, item: EngineChunk) -> None:
        self.queue.put_nowait(item)

    async def chunks(self):
        finished = False
        try:
            while not finished:
                item = await self.queue.get()
                finished = item.finish_reason is not None
                yield item
        finally:
            self.aborted = not finished


async def collect(iterator) -> list:
    return [item async for item in iterator]


def test_without_a_channel_the_chunks_follow_the_route_on_the_request_stream():
    async def run():
        host, stream = ChannelHost("replica-a"), ScriptedStream()
        stream.push(chunk(1))
        stream.push(chunk(2, "length"))
        return await collect(host.generate(stream.chunks(), "r1", "ingress-1"))

    assert asyncio.run(run()) == [ChannelRoute("replica-a", False), chunk(1), chunk(2, "length")]


def test_with_a_channel_one_batch_carries_what_one_step_pushed_for_every_request():
    async def run():
        host = ChannelHost("replica-a")
        channel = host.channel("ingress-1", "replica-a")
        assert await channel.__anext__() == ChannelOpened("replica-a")
        streams = {rid: ScriptedStream() for rid in ("r1", "r2")}
        own = {rid: asyncio.create_task(collect(host.generate(s.chunks(), rid, "ingress-1")))
               for rid, s in streams.items()}
        await asyncio.sleep(0)
        batches = []
        for step in (1, 2):
            for s in streams.values():  # one engine step: every request's chunk pushed in one loop turn
                s.push(chunk(step, "length" if step == 2 else None))
            batches.append(await channel.__anext__())
        await channel.aclose()
        return batches, {rid: await task for rid, task in own.items()}

    batches, own = asyncio.run(run())
    assert batches == [[("r1", chunk(1)), ("r2", chunk(1))], [("r1", chunk(2, "length")), ("r2", chunk(2, "length"))]]
    assert own == {rid: [ChannelRoute("replica-a", True)] for rid in ("r1", "r2")}  # nothing else on their own


def test_a_channel_closes_when_idle_but_not_under_a_request():
    async def run():
        host = ChannelHost("replica-a", idle_close_s=0.05)
        channel = host.channel("ingress-1", "replica-a")
        await channel.__anext__()
        stream = ScriptedStream()
        own = asyncio.create_task(collect(host.generate(stream.chunks(), "r1", "ingress-1")))
        await asyncio.sleep(0.2)  # four idle periods with a request in flight: still open
        stream.push(chunk(1, "length"))
        batch = await channel.__anext__()
        await own
        rest = await asyncio.wait_for(collect(channel), 1)  # idle, no request: it ends by itself
        return batch, rest, host.outboxes

    batch, rest, outboxes = asyncio.run(run())
    assert batch == [("r1", chunk(1, "length"))] and rest == [] and outboxes == {}


def test_a_closed_channel_aborts_the_requests_routed_through_it():
    async def run():
        host = ChannelHost("replica-a")
        channel = host.channel("ingress-1", "replica-a")
        await channel.__anext__()
        stream = ScriptedStream()
        own = host.generate(stream.chunks(), "r1", "ingress-1")
        assert await own.__anext__() == ChannelRoute("replica-a", True)
        await channel.aclose()  # the ingress went away
        stream.push(chunk(1))
        with pytest.raises(EngineUnavailableError, match="channel to the ingress replica closed"):
            await own.__anext__()
        return stream.aborted

    assert asyncio.run(run())


def test_a_channel_call_routed_to_another_replica_is_refused():
    async def run():
        await ChannelHost("replica-a").channel("ingress-1", "replica-b").__anext__()

    with pytest.raises(EngineUnavailableError, match="replica-b reached replica replica-a"):
        asyncio.run(run())
