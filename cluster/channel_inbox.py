"""The ingress half of the engine -> ingress token channels (cluster/engine_channel.py has the engine half).

`ChannelInbox` owns this ingress replica's channels (one reader task per engine replica) and one queue per
request in flight. A request is subscribed before it is sent, so no chunk of it can arrive unheard. Its engine
stream's first item (`ChannelRoute`) says where its chunks come from:

* via the channel: `chunks` reads the request's queue and, beside it, drains the request's own stream, which
  ends quietly after the final chunk was queued on the engine, or raises what the engine raised (overload, a
  lost group, the replica's death, a cancellation); that error is raised to the consumer in the chunk order;
* on its own stream (no channel to that replica yet): the caller reads the stream, and `ensure` opens a channel
  to that replica for the requests after it.

A channel that ends (its replica died, or it closed idle) fails every request still routed through it: with the
replica's `RayActorError` when that is why, so a request that streamed nothing is retried like any other.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cluster.engine_channel import ChannelOpened
from cp_router.detached import detached_task
from cp_router.protocol import EngineChunk, EngineUnavailableError, one_line

logger = logging.getLogger("dsa_serve.ingress")
CHANNEL_OPEN_TIMEOUT_S = 10.0
CHANNEL_RETRY_AFTER_S = 30.0  # a channel that failed or never opened: its replica's requests stream on their own


class ChannelInbox:
    """Per-request queues fed by the channels from the engine replicas."""

    def __init__(self, stream_handle: DeploymentHandle, open_timeout_s: float = CHANNEL_OPEN_TIMEOUT_S):
        self.stream_handle, self.open_timeout_s = stream_handle, open_timeout_s  # the engine handle, stream=True
        self.ingress_id = uuid.uuid4().hex  # this ingress replica, to the engine replicas
        self.queues: dict[str, asyncio.Queue[EngineChunk | BaseException]] = {}
        self.routes: dict[str, str] = {}  # request id -> the replica whose channel carries it
        self.readers: dict[str, asyncio.Task] = {}  # replica id -> its channel's reader (opening or open)
        self.not_before: dict[str, float] = {}  # replica id -> when to try again after its channel failed

    def subscribe(self, request_id: str) -> None:
        self.queues[request_id] = asyncio.Queue()

    def unsubscribe(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.routes.pop(request_id, None)

    def ensure(self, replica_id: str) -> None:
        """A channel from `replica_id`, opened in the background unless one is open or opening."""
        if replica_id not in self.readers and asyncio.get_running_loop().time() >= self.not_before.get(replica_id, 0):
            self.readers[replica_id] = detached_task(self._read(replica_id))  # outlives the request that opened it

    async def chunks(self, request_id: str, replica_id: str,
                     response: DeploymentResponseGenerator) -> AsyncIterator[EngineChunk]:
        """The chunks of a request routed through `replica_id`'s channel, up to its final one."""
        self.routes[request_id] = replica_id
        queue = self.queues[request_id]
        if replica_id not in self.readers:  # the channel ended between the engine's decision and now
            queue.put_nowait(EngineUnavailableError(f"the channel from engine replica {replica_id} ended"))
        watcher = asyncio.get_running_loop().create_task(self._watch(response, queue))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                watcher.cancel()

    @staticmethod
    async def _watch(response: DeploymentResponseGenerator, queue: asyncio.Queue) -> None:
        """Drains the request's own stream (nothing after its route): its error, if any, goes to the queue."""
        try:
            async for _ in response:
                pass
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the engine raised is the consumer's to handle
            queue.put_nowait(exc)

    async def _read(self, replica_id: str) -> None:
        lost: BaseException | None = None
        ended = False
        stream = self.stream_handle.channel.remote(self.ingress_id, target_replica=replica_id)
        try:
            opened = await asyncio.wait_for(stream.__anext__(), self.open_timeout_s)
            assert isinstance(opened, ChannelOpened), opened
            logger.info("channel from engine replica %s open: its chunks for this ingress come batched per step",
                        replica_id)
            async for batch in stream:
                for request_id, chunk in batch:
                    queue = self.queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)
            ended = True
        except asyncio.TimeoutError:
            logger.warning("no channel from engine replica %s within %gs: its requests stream on their own",
                           replica_id, self.open_timeout_s)
        except RayActorError as exc:
            lost = exc
        except Exception as exc:  # noqa: BLE001 - any other end of the channel fails the requests it carried
            lost = EngineUnavailableError(f"the channel from engine replica {replica_id} failed: {one_line(exc)}")
            logger.warning("%s", lost)
        finally:
            if not ended:
                stream.cancel()
                self.not_before[replica_id] = asyncio.get_running_loop().time() + CHANNEL_RETRY_AFTER_S
            del self.readers[replica_id]
            self._fail_routed(replica_id, lost or EngineUnavailableError(
                f"the channel from engine replica {replica_id} ended"))

    def _fail_routed(self, replica_id: str, error: BaseException) -> None:
        for request_id, routed_to in list(self.routes.items()):
            if routed_to == replica_id and request_id in self.queues:
                self.queues[request_id].put_nowait(error)
