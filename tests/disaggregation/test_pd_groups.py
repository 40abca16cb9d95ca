"""Disaggregation between Ray rank groups (engines in this process, deterministic inference, MTP k = 2): a prefill
group of C = 2 ranks (CP, both strategies) hands off to a decode group of D = 2 ranks with the experts partitioned
across them (EP = 2, DP-attention decode); every request's tokens and logprobs are bit-identical to one colocated
C = 1 engine's, greedy and seeded, bf16 and FP8 KV, and the decode group's two ranks both decode hand-offs."""

from __future__ import annotations

import pytest

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import engine_cpus, launch_group, start_ray
from cp_router.disaggregated import DisaggregatedEngine
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine
from test_pd_engine import outcomes, prompt

pytestmark = pytest.mark.slow  # Ray groups / a Serve app on a local Ray: `make test-slow`
MODEL = resolve_model_dir(None)
NUM_PAGES, PAGE_SIZE = 64, 32
REQUESTS = [EngineRequest(f"g{i}", prompt(9 + 83 * i, 70 + i), 10, temperature=0.0 if i % 2 == 0 else 0.9, seed=i,
                          ignore_eos=True, logprobs=2) for i in range(6)]


def options(**overrides) -> EngineOptions:
    return EngineOptions(**{**dict(dtype="bfloat16", num_pages=NUM_PAGES, page_size=PAGE_SIZE, deterministic=True,
                                   num_speculative_steps=2, cp_min_prefill_tokens=0), **overrides})


@pytest.fixture(scope="module")
def groups():
    start_ray(min_cpus=2 * engine_cpus(2))
    layouts = {"prefill": ResolvedCPConfig(True, 2, "zigzag", "legacy"),
               "decode": ResolvedCPConfig(True, 2, "zigzag", "legacy", ep_size=2)}
    launched = {kind: launch_group(MODEL, cp, "bfloat16", NUM_PAGES, PAGE_SIZE, deterministic=True)
                for kind, cp in layouts.items()}
    yield launched
    for group in launched.values():
        group.shutdown()
    import ray

    ray.shutdown()


@pytest.mark.parametrize("strategy,impl,kv", [("zigzag", "legacy", "auto"), ("interleave", "v2", "auto"),
                                               ("interleave", "v2", "fp8_e4m3")])  # FP8 last: it reloads the groups
def test_cp2_prefill_to_ep2_decode_is_bit_identical_to_colocated(groups, strategy, impl, kv):
    import ray

    colocated = outcomes(local_engine(MODEL, options(kv_cache_dtype=kv)), REQUESTS)
    prefill_spec = resolve_engine_spec(MODEL, ResolvedCPConfig(True, 2, strategy, impl), options(kv_cache_dtype=kv))
    decode_cp = ResolvedCPConfig(True, 2, "zigzag", "legacy", ep_size=2)
    decode_spec = resolve_engine_spec(MODEL, decode_cp, options(kv_cache_dtype=kv))
    if kv != "auto":
        ray.get([w.load.remote(spec.rank) for spec, kind in ((prefill_spec, "prefill"), (decode_spec, "decode"))
                 for w in groups[kind].workers])
    prefill = engine_over_workers(prefill_spec, groups["prefill"].workers)
    decode = engine_over_workers(decode_spec, groups["decode"].workers)
    owners = set()
    decode.add_step_observer(lambda step, results: owners.update(
        r for r, plan in step.plans.items() if plan.imports))
    assert outcomes(DisaggregatedEngine(decode, prefill), REQUESTS) == colocated
    assert owners == {0, 1}
