"""Prefix-aware routing end to end: the Serve app of cluster/serve_app.py with two DSAEngine replicas (separate
placement, C = 1, the default model) on a local Ray, called through a deployment handle of DSAEngine, whose router
is the deployment's own (cluster/engine_router.py). The first item of each engine stream (`ChannelRoute`) names the
replica that took the request: prompts sharing a prefix land on one replica, a second prefix on the other. Over
HTTP, where the DSAIngress replica's own router routes, the engines' per-replica request counts show the same."""

from __future__ import annotations

import random
import re

import httpx
import pytest
from ray import serve

from cluster.engine_channel import ChannelRoute
from cluster.serve_app import APP_NAME, ENGINE_DEPLOYMENT
from cp_router.protocol import EngineRequest
from support.serve_process import serve_app_in_process

PAGE_SIZE, VOCAB = 64, 6144  # the default model's vocabulary
pytestmark = pytest.mark.slow  # two engine replicas on a local Ray: `make test-slow`


@pytest.fixture(scope="module")
def served():
    """(a streaming handle of DSAEngine, the app's base URL): two engine replicas, on a local Ray of this module."""
    settings = {"cp_size": 1, "engine_placement": "separate", "page_size": PAGE_SIZE}
    with serve_app_in_process(settings, num_cpus=6, engine_replicas=2) as base_url:
        yield serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME).options(stream=True), base_url


def tokens(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(1, VOCAB) for _ in range(length)]


def replica_of(handle, request_id: str, prompt: list[int]) -> str:
    """The replica that streamed the request (its first item), after the whole stream was read."""
    stream = handle.generate.remote(EngineRequest(request_id, tuple(prompt), 2, temperature=0.0, ignore_eos=True))
    items = list(stream)
    assert isinstance(items[0], ChannelRoute) and items[-1].finish_reason == "length", items
    return items[0].replica_id


def test_prompts_sharing_a_prefix_land_on_one_replica_and_distinct_prefixes_spread(served):
    engine = served[0]
    prefixes = {"a": tokens(1, 2 * PAGE_SIZE), "b": tokens(2, 2 * PAGE_SIZE)}  # two whole pages each
    routes: dict[str, list[str]] = {"a": [], "b": []}
    for turn in range(4):
        for name, prefix in prefixes.items():
            question = tokens(100 + 10 * turn + ord(name), 5 + turn)
            routes[name].append(replica_of(engine, f"{name}{turn}", prefix + question))
    assert len(set(routes["a"])) == 1 and len(set(routes["b"])) == 1, routes
    assert routes["a"][0] != routes["b"][0], routes  # the second prefix went to the replica sent nothing yet


def finished_per_replica(base_url: str) -> dict[str, float]:
    """Requests each engine replica finished, from the ingress's merged /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=60).text
    counts: dict[str, float] = {}
    for labels, value in re.findall(r'^dsa_serve:request_success_total\{([^}]*)\} (\S+)$', text, re.MULTILINE):
        replica = re.search(r'replica="(engine-[^"]*)"', labels)
        if replica:
            counts[replica.group(1)] = counts.get(replica.group(1), 0.0) + float(value)
    return counts


def test_over_http_the_ingress_sends_a_shared_prefix_to_one_replica(served):
    base_url, prefix = served[1], tokens(3, 2 * PAGE_SIZE)
    before = finished_per_replica(base_url)
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for turn in range(5):  # all five on one replica: 1 in 16 by chance alone
            body = {"model": "default_model", "prompt": prefix + tokens(200 + turn, 4 + turn), "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
    after = finished_per_replica(base_url)
    grown = {replica: count - before.get(replica, 0.0) for replica, count in after.items()}
    assert [count for count in grown.values() if count] == [5.0], (before, after)
