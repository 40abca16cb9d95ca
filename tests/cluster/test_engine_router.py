"""DSAEngine's request router (cluster/engine_router.py) and its prefix index (cluster/prefix_index.py).

The router is driven as Serve drives it, and as Ray's own tests of its routers build them
(python/ray/serve/tests/unit/test_pow_2_request_router.py in Ray's repository): Serve's `RunningReplica`
subclassed to answer a set queue length, the router built with a deployment id and a handle source, replicas
given with `update_replicas`, a request routed with `_choose_replica_for_request`; what Serve's Router then calls
once the replica accepted the call (`on_request_routed`) is called the same way here.
"""

from __future__ import annotations

import asyncio
import threading
from itertools import count

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router import PendingRequest, RunningReplica

from cluster import cli
from cluster.commands.serve import app_args
from cluster.engine_router import EngineRouter
from cluster.prefix_index import NO_MATCH, PrefixIndex, PrefixMatch, prefix_keys
from cluster.serve_app import engine_router_config
from cluster.serve_settings import ServeAppArgs
from cp_router.protocol import EngineRequest

BLOCK = 4  # tokens per prefix block in these tests
DEPLOYMENT = DeploymentID(name="DSAEngine", app_name="dsa-serve")
REQUEST_IDS = count()


class FixedLoadReplica(RunningReplica):
    """A replica that answers Serve's queue-length probe with `load` (Ray's tests' FakeRunningReplica, shortened)."""

    def __init__(self, unique_id: str, load: int = 0, max_ongoing_requests: int = 100):
        self._replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.load, self._max_ongoing_requests = load, max_ongoing_requests

    replica_id = property(lambda self: self._replica_id)
    node_id = property(lambda self: "")
    availability_zone = property(lambda self: None)
    multiplexed_model_ids = property(lambda self: set())
    max_ongoing_requests = property(lambda self: self._max_ongoing_requests)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.load

    def push_proxy_handle(self, handle) -> None:
        pass


def engine_router(replicas: list[FixedLoadReplica], **state) -> EngineRouter:
    """An EngineRouter over `replicas` (call inside a running loop: Serve's router binds to it)."""
    router = EngineRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                          use_replica_queue_len_cache=False)
    router.initialize_state(**{"block_tokens": BLOCK, "imbalance_threshold": 2, **state})
    router.update_replicas(replicas)
    return router


def call(method: str, *args, **kwargs) -> PendingRequest:
    request_id = f"call-{next(REQUEST_IDS)}"
    return PendingRequest(args=list(args), kwargs=kwargs, metadata=RequestMetadata(
        request_id=request_id, internal_request_id=request_id, call_method=method, is_streaming=True))


async def route(router: EngineRouter, prompt: list[int], method: str = "generate") -> str:
    """The replica a `generate` call of `prompt` goes to; the router then learns it, as after Serve's send."""
    pending = call(method, EngineRequest(f"r{next(REQUEST_IDS)}", tuple(prompt), 4), "ingress-1")
    replica = await router._choose_replica_for_request(pending)
    router.on_request_routed(pending, replica.replica_id, None)
    return replica.replica_id.unique_id


PREFIX_A, PREFIX_B = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]


def test_prompts_sharing_a_prefix_stay_together_and_distinct_prefixes_spread():
    async def run():
        router = engine_router([FixedLoadReplica("a"), FixedLoadReplica("b")])
        first_a = await route(router, PREFIX_A + [20, 21])
        first_b = await route(router, PREFIX_B + [30])
        again = [await route(router, PREFIX_A + [40 + i] * 5) for i in range(4)]
        b_again = await route(router, PREFIX_B + [50, 51, 52, 53])
        return first_a, first_b, again, b_again

    first_a, first_b, again, b_again = asyncio.run(run())
    assert first_b != first_a  # equally loaded: the replica sent fewer blocks takes the new prefix
    assert again == [first_a] * 4 and b_again == first_b


def test_prefill_handoff_calls_of_a_disaggregated_app_are_routed_by_prefix_too():
    async def run():
        router = engine_router([FixedLoadReplica("a"), FixedLoadReplica("b")])
        first_a = await route(router, PREFIX_A + [20], "prefill_handoff")
        first_b = await route(router, PREFIX_B + [30], "prefill_handoff")
        return first_a, first_b, [await route(router, PREFIX_A + [40 + i], "prefill_handoff") for i in range(3)]

    first_a, first_b, again = asyncio.run(run())
    assert first_a != first_b and again == [first_a] * 3


def test_the_longest_shared_prefix_wins():
    async def run():
        a, b = FixedLoadReplica("a"), FixedLoadReplica("b")
        router = engine_router([a, b], imbalance_threshold=2)
        x = await route(router, PREFIX_B)
        y = await route(router, PREFIX_A[:4] + [70, 71, 72, 73])  # y: the first block of PREFIX_A
        replicas = {"a": a, "b": b}
        replicas[y].load = 3  # overloaded: PREFIX_A's next prompt goes to x, which then holds both its blocks
        moved = await route(router, PREFIX_A + [90])
        replicas[y].load = 0
        return x, y, moved, await route(router, PREFIX_A + [91])

    x, y, moved, longest = asyncio.run(run())
    assert x != y and moved == x and longest == x  # two blocks on x beat one on y, at equal load


def test_an_overloaded_holder_loses_its_prompts_to_the_least_loaded_replica():
    async def run():
        a, b = FixedLoadReplica("a"), FixedLoadReplica("b")
        router = engine_router([a, b], imbalance_threshold=2)
        holder = await route(router, PREFIX_A)
        busy, idle = (a, b) if holder == "a" else (b, a)
        busy.load = 2  # 2 ongoing over the least-loaded replica's 0: within the threshold, the prefix wins
        within = await route(router, PREFIX_A + [98])
        busy.load = 3  # more than the threshold: the least-loaded replica takes it
        overloaded = await route(router, PREFIX_A + [99])
        return busy.replica_id.unique_id, idle.replica_id.unique_id, holder, overloaded, within

    busy, idle, holder, overloaded, within = asyncio.run(run())
    assert holder == busy and overloaded == idle and within == busy


def test_a_full_holder_is_passed_over():
    async def run():
        a, b = FixedLoadReplica("a", max_ongoing_requests=1), FixedLoadReplica("b", max_ongoing_requests=1)
        router = engine_router([a, b], imbalance_threshold=100)
        holder = await route(router, PREFIX_A)
        (a if holder == "a" else b).load = 1  # full: Serve would refuse to send it more
        return holder, await route(router, PREFIX_A)

    holder, second = asyncio.run(run())
    assert second != holder


def test_replicas_that_leave_drop_out_of_the_index():
    async def run():
        a, b, c = FixedLoadReplica("a"), FixedLoadReplica("b"), FixedLoadReplica("c")
        router = engine_router([a, b, c])
        holders = {await route(router, prefix) for prefix in (PREFIX_A, PREFIX_B, [60] * 8)}
        keys_a = router.prefix_index.keys(PREFIX_A)
        replaced = router.prefix_index.longest_match(keys_a, {"a", "b", "c"}).replicas[0]
        router.update_replicas([r for r in (a, b, c) if r.replica_id.unique_id != replaced])  # scaled down
        after_update = router.prefix_index.longest_match(keys_a, {"a", "b", "c"})
        died = router.prefix_index.longest_match(router.prefix_index.keys(PREFIX_B), {"a", "b", "c"}).replicas[0]
        router.on_replica_actor_died(ReplicaID(unique_id=died, deployment_id=DEPLOYMENT))
        named = {replica for holders in router.prefix_index.entries.values() for replica in holders}
        return holders, replaced, after_update, died, named, router.prefix_index.blocks_of(replaced)

    holders, replaced, after_update, died, named, blocks = asyncio.run(run())
    assert holders == {"a", "b", "c"}  # three distinct prefixes over three idle replicas
    assert after_update == NO_MATCH and blocks == 0
    assert replaced not in named and died not in named and len(named) == 1


def test_with_prefix_aware_routing_off_a_prompt_goes_by_load_alone():
    async def run():
        a, b = FixedLoadReplica("a"), FixedLoadReplica("b")
        router = engine_router([a, b], prefix_aware=False)
        holder = await route(router, PREFIX_A)
        (a if holder == "a" else b).load = 1  # prefix-aware, within the threshold of 2, it would stay there
        return holder, [await route(router, PREFIX_A + [i]) for i in range(4)], router.prefix_index

    holder, later, index = asyncio.run(run())
    assert index is None and holder not in later


def test_a_channel_goes_to_the_replica_it_names_and_waits_with_backoff_when_that_one_is_gone():
    async def run():
        router = engine_router([FixedLoadReplica("a"), FixedLoadReplica("b", load=50)])
        named = [await router._choose_replica_for_request(call("channel", "ingress-1", target_replica="b"))
                 for _ in range(3)]
        try:
            gone = await asyncio.wait_for(
                router._choose_replica_for_request(call("channel", "ingress-1", target_replica="c")), 0.3)
        except asyncio.TimeoutError:
            gone = None  # still waiting: its opener's timeout cancels it
        return [replica.replica_id.unique_id for replica in named], gone

    result: list = []
    # A routing loop that never yields (no backoff) would hang asyncio.run; the thread bounds the wait.
    worker = threading.Thread(target=lambda: result.append(asyncio.run(run())), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "routing a channel to a gone replica never yielded the event loop"
    assert result == [(["b", "b", "b"], None)]


def test_prefix_keys_name_whole_block_prefixes():
    shared = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(shared) == 2  # the ninth token is no whole block
    assert prefix_keys([1, 2, 3, 4, 0, 6, 7, 8], BLOCK)[0] == shared[0]
    assert prefix_keys([1, 2, 3, 4, 0, 6, 7, 8], BLOCK)[1] != shared[1]
    assert prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1] != shared[1]  # key 1 names blocks 0 and 1
    assert prefix_keys([1, 2, 3], BLOCK) == []


def test_the_index_is_bounded_and_forgets_long_tails_before_shared_prefixes():
    index = PrefixIndex(BLOCK, max_blocks=3)
    system = [7] * BLOCK
    index.record(index.keys(system + [1] * BLOCK + [2] * BLOCK), "a")  # 3 keys: the bound
    index.record(index.keys(system + [3] * BLOCK), "b")  # the shared first key moves to b's end; one key new
    long_keys = index.keys(system + [1] * BLOCK + [2] * BLOCK)
    assert len(index.entries) == 3 and long_keys[2] not in index.entries  # a's longest tail went first
    assert index.longest_match(long_keys, {"a", "b"}) == PrefixMatch(2, ("a",))
    assert index.longest_match(index.keys(system), {"a", "b"}).replicas == ("b", "a")  # latest first
    assert (index.blocks_of("a"), index.blocks_of("b")) == (2, 2)
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixIndex(0)


def test_the_switches_and_the_page_size_reach_the_routers_settings():
    on = engine_router_config(ServeAppArgs(page_size=32)).request_router_kwargs
    assert on == {"prefix_aware": True, "block_tokens": 32}
    for no_cache in ({"enable_prefix_caching": False}, {"disable_radix_cache": True}):  # nothing to route to
        assert engine_router_config(ServeAppArgs(**no_cache)).request_router_kwargs["prefix_aware"] is False
    for argv in (["serve", "--no-prefix-aware-routing"], ["serve", "--prefix-aware-routing"], ["serve"]):
        args = app_args(cli.build_parser().parse_args(argv))
        assert args.prefix_aware_routing is ("--no-prefix-aware-routing" not in argv)
        assert engine_router_config(args).request_router_kwargs["prefix_aware"] is args.prefix_aware_routing
