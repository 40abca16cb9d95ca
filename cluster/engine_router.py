"""`EngineRouter`: the Serve request router of the `DSAEngine` deployment (separate placement), and of `DSAPrefill`
(disaggregated: its `prefill_handoff` calls are routed by prompt as `generate` calls are).

Serve builds one router per deployment handle (each DSAIngress replica's, or a driver's) from DSAEngine's
`request_router_config` (cluster/serve_app.py) and asks it, per call, which engine replica takes the call:

* `channel` calls (cluster/engine_channel.py) go to the replica named by their `target_replica` argument.
* `generate` calls, with prefix-aware routing on (`prefix_aware_routing` and `enable_prefix_caching`), go to the
  replica that was sent the longest prefix of the prompt's token ids (`PrefixIndex`, cluster/prefix_index.py, in
  blocks of the KV page size), whose prefix cache most likely still holds those pages; unless that replica has
  more than `imbalance_threshold` ongoing requests over the least-loaded replica, or no room. Failing that, or
  with no block of the prompt sent anywhere yet, the least-loaded replica; among equally loaded ones, the one
  that was sent the fewest blocks, so distinct prefixes spread over the replicas. Load is Serve's count of a
  replica's ongoing requests (engine streams, plus one per open token channel), from the router's cache or
  probed. The index learns where each accepted call went (`on_request_routed`) and forgets a replica once it
  leaves the deployment. Serve's preference for replicas on the caller's node does not apply to these calls.
* Every other call (`model_info`, or `generate` with prefix-aware routing off) takes Serve's power-of-two choice.

Each router has its own index: with several ingress replicas, each learns on its own, so a prefix may be held
by up to one engine replica per ingress replica. (Ray Serve LLM's `PrefixCacheAffinityRouter` shares one prefix
tree in a detached actor instead, at one blocking `ray.get` per request on the caller's event loop, and matches
prompt text rather than token ids; docs/deployment.md, 'Prefix-aware routing'.)

Requests are matched to the replica chosen for them exactly (Serve's `RequestRouter` default), not first come
first served as in the power-of-two router's FIFO mixin, which could hand a replica chosen for one call (a channel's
target, a prefix's holder) to an older pending call.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router import PendingRequest, PowerOfTwoChoicesRequestRouter, RunningReplica
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from cluster.engine_channel import CHANNEL_METHOD
from cluster.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex, PrefixMatch
from cp_router.protocol import EngineRequest

GENERATE_METHOD = "generate"  # the DSAEngine method routed by its prompt
PROMPT_METHODS = (GENERATE_METHOD, "prefill_handoff")  # methods whose first argument is an EngineRequest
DEFAULT_IMBALANCE_THRESHOLD = 32  # ongoing requests over the least-loaded replica (SGLang's balance_abs_threshold)


def engine_request(pending_request: PendingRequest | None) -> EngineRequest | None:
    """The `EngineRequest` of a pending `generate` call, else None."""
    if pending_request is None or pending_request.metadata.call_method not in PROMPT_METHODS:
        return None
    request = pending_request.args[0] if pending_request.args else pending_request.kwargs.get("request")
    return request if isinstance(request, EngineRequest) else None


def preferred_order(loads: dict[str, int], match: PrefixMatch, blocks_of, imbalance_threshold: int) -> list[str]:
    """Replica ids in the order to try: the holders of the longest match that are not overloaded (least loaded
    first), then every other replica by load, then by fewest blocks sent; remaining ties in random order."""
    least = min(loads.values())
    holders = sorted((r for r in match.replicas if r in loads and loads[r] - least <= imbalance_threshold),
                     key=loads.__getitem__)
    others = random.sample([r for r in loads if r not in holders], len(loads) - len(holders))
    return holders + sorted(others, key=lambda r: (loads[r], blocks_of(r)))


class EngineRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Channels to their replica, prompts to the replica holding their longest prefix, the rest power-of-two."""

    prefix_index: PrefixIndex | None = None  # None: prefix-aware routing off (set by initialize_state)
    imbalance_threshold = DEFAULT_IMBALANCE_THRESHOLD

    def initialize_state(self, prefix_aware: bool = True, block_tokens: int = 64,
                         max_blocks: int = DEFAULT_MAX_BLOCKS,
                         imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD, **_: Any) -> None:
        """Called by Serve with the deployment's `request_router_kwargs`."""
        self.prefix_index = PrefixIndex(block_tokens, max_blocks) if prefix_aware else None
        self.imbalance_threshold = imbalance_threshold

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.call_method == CHANNEL_METHOD:
            return self._channel_target(candidate_replicas, pending_request)
        request = engine_request(pending_request)
        if request is None or self.prefix_index is None:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        pending_request.routing_context.should_backoff = True  # every replica was considered: back off next time
        return await self._by_prefix(candidate_replicas, request)

    async def _by_prefix(self, candidate_replicas: list[RunningReplica],
                         request: EngineRequest) -> list[list[RunningReplica]]:
        """One replica per rank, in `preferred_order`: Serve takes the first that accepts the call."""
        loads = await self._loads(candidate_replicas)
        if not loads:
            return []  # none answered, or all full: Serve backs off and asks again
        keys = self.prefix_index.keys(request.prompt_token_ids)
        match = self.prefix_index.longest_match(keys, loads)
        order = preferred_order(loads, match, self.prefix_index.blocks_of, self.imbalance_threshold)
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        return [[by_id[replica]] for replica in order]

    def _channel_target(self, candidate_replicas: list[RunningReplica],
                        pending_request: PendingRequest) -> list[list[RunningReplica]]:
        """The replica a `channel` call names; none when it is gone (Serve then retries, backing off, until the
        opener's timeout cancels the call: without the backoff that retry loop never yields the event loop)."""
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get("target_replica")
        chosen = [replica for replica in candidate_replicas if replica.replica_id.unique_id == target]
        return [chosen] if chosen else []

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Ongoing requests of each replica with room for one more: cached, else probed (as Serve's own selection
        does, a cached full replica is probed again). Replicas that do not answer in time are left out."""
        loads, unknown = {}, []
        for replica in replicas:
            cached = self._replica_queue_len_cache.get(replica.replica_id) if self._use_replica_queue_len_cache \
                else None
            if cached is None or cached >= replica.max_ongoing_requests:
                unknown.append(replica)
            else:
                loads[replica.replica_id.unique_id] = cached
        for replica, probed in await self._probe_queue_lens(unknown, 0):
            if probed is not None and probed < replica.max_ongoing_requests:
                loads[replica.replica_id.unique_id] = probed
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """A replica accepted the call: it now holds (or is computing) the prompt's prefix."""
        request = engine_request(pending_request)
        if request is not None and self.prefix_index is not None:
            self.prefix_index.record(self.prefix_index.keys(request.prompt_token_ids), replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {replica_id.unique_id for replica_id in self._replica_id_set}
        super().update_replicas(replicas)
        if self.prefix_index is not None:
            self.prefix_index.drop_replicas(before - {replica.replica_id.unique_id for replica in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if self.prefix_index is not None:
            self.prefix_index.drop_replicas({replica_id.unique_id})
