"""One CP group spread over two Ray nodes (two raylets on this machine, Ray's own `cluster_utils.Cluster`):
C = 2 across the nodes gives the bits of one rank alone (deterministic mode), and taking the second node away
mid-stream makes the engine re-place the lost rank on the surviving node and resume every request, bit-exact."""

from __future__ import annotations

import os

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import launch_group
from cluster.rank_repair import RayRankRepair
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine
from support.streams import act_after_steps, outcomes

pytestmark = pytest.mark.slow  # a Ray Serve deployment driven end to end (minutes): `make test-slow`

MODEL = resolve_model_dir(None)
CP = ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="legacy")
DTYPE, NUM_PAGES, PAGE_SIZE, VOCAB = "bfloat16", 64, 64, 6144


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


REQUESTS = [EngineRequest(f"m{i}", prompt(40 + 150 * i, 50 + i), 24, temperature=0.0 if i % 2 == 0 else 0.7,
                          seed=7 + i, ignore_eos=True, logprobs=1) for i in range(4)]


def options() -> EngineOptions:
    return EngineOptions(dtype=DTYPE, num_pages=NUM_PAGES, page_size=PAGE_SIZE, deterministic=True,
                         prefill_token_budget=256)


@pytest.fixture(scope="module")
def two_nodes():
    """A head node with room for both ranks (where a lost rank is re-placed) and a second node with one CPU."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster, second
    ray.shutdown()
    cluster.shutdown()


def node_of(worker) -> str:
    return ray.get(worker.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


@pytest.fixture(scope="module")
def alone():
    """The requests on one rank in this process: what C = 2 over two nodes must reproduce bit for bit."""
    return outcomes(local_engine(MODEL, options()), REQUESTS)


def test_cp_across_two_nodes_equals_one_rank_and_survives_losing_the_second_node(two_nodes, alone):
    cluster, second = two_nodes
    group = launch_group(MODEL, CP, DTYPE, NUM_PAGES, PAGE_SIZE, deterministic=True, placement_strategy="SPREAD")
    try:
        nodes = [node_of(w) for w in group.workers]
        assert len(set(nodes)) == 2 and second.node_id in nodes
        engine = engine_over_workers(resolve_engine_spec(MODEL, CP, options()), group.workers,
                                     repair=RayRankRepair(group.launch))
        assert outcomes(engine, REQUESTS) == alone
        removed = act_after_steps(engine, 3, lambda: cluster.remove_node(second) or os.getpid())
        assert outcomes(engine, REQUESTS) == alone
        assert removed
        (record,) = engine.recoveries
        assert record.ok and record.lost_ranks == (nodes.index(second.node_id),) and record.resumed == 4
        assert {node_of(w) for w in group.workers} == {cluster.head_node.node_id}
        assert engine.free_pages == [NUM_PAGES, NUM_PAGES]
    finally:
        group.shutdown()
