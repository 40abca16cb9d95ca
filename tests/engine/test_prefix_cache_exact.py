"""Prefix-cache hits change no bit (--enable-deterministic-inference, the default model): a request served after a
hit gives the tokens, logprobs (and top alternatives), the first MTP draft after its prefill and the accepted
drafts of the same request on an engine with the cache off. Hits of three kinds: a document then another question
(a long suffix: CP over both ranks at C = 2), a short suffix (one rank at C = 2), and the next turn of a finished
chat (prompt + answer cached). C = 1 in bf16 and FP8 KV, k = 0 and 2, greedy and seeded; C = 2 with both
strategies, v2 and legacy, EP = 1 and 2."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import engine_cpus, launch_group, start_ray
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine

MODEL = resolve_model_dir(None)
DTYPE, NUM_PAGES, PAGE_SIZE, MAX_TOKENS, VOCAB = "bfloat16", 64, 64, 8, 6144


def ids(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


DOC = ids(320, 1)  # five pages


def request(name: str, prompt: tuple[int, ...], sampled: bool) -> EngineRequest:
    return EngineRequest(name, prompt, MAX_TOKENS, temperature=0.8 if sampled else 0.0, seed=11 if sampled else None,
                         ignore_eos=True, logprobs=2)


def options(kv: str, k: int, caching: bool, budget: int = 2048) -> EngineOptions:
    return EngineOptions(DTYPE, NUM_PAGES, PAGE_SIZE, k, prefill_token_budget=budget, kv_cache_dtype=kv,
                         deterministic=True, enable_prefix_caching=caching)


class Recorder:
    """A step observer: each request's first draft after its prefill and its accepted drafts per position."""

    def __init__(self):
        self.first_draft: dict[str, int | None] = {}
        self.accepted: dict[str, list[int]] = {}

    def __call__(self, step, results) -> None:
        finals = {p.request_id for p in step.prefill.pieces if p.final} if step.prefill is not None else set()
        for result in results:
            for request_id, out in result.outputs.items():
                if request_id in finals:
                    self.first_draft[request_id] = out.draft_token_id
                elif out.accepted_per_position:
                    total = self.accepted.setdefault(request_id, [0] * len(out.accepted_per_position))
                    self.accepted[request_id] = [a + b for a, b in zip(total, out.accepted_per_position)]


def serve_in_turn(engine, requests: list[EngineRequest]) -> dict[str, dict]:
    """Each request run to its end before the next starts: tokens, logprobs, cached tokens, drafts."""
    recorder = Recorder()
    engine.add_step_observer(recorder)

    async def one(req):
        chunks = [chunk async for chunk in engine.generate(req)]
        return {"tokens": [t for c in chunks for t in c.token_ids], "cached": chunks[-1].cached_tokens,
                "logprobs": [(lp.logprob, lp.top) for c in chunks for lp in (c.logprobs or ())]}

    async def main():
        return {req.request_id: await one(req) for req in requests}

    out = asyncio.run(main())
    for request_id, result in out.items():
        result.update(first_draft=recorder.first_draft.get(request_id), accepted=recorder.accepted.get(request_id))
    return out


def hit_requests(sampled: bool, warm_output: list[int]) -> list[EngineRequest]:
    """After the warm-up request (DOC + a question): another question, a short suffix, the chat's next turn."""
    warm_prompt = DOC + ids(60, 2)
    return [request("long_suffix", DOC + ids(100, 3), sampled), request("short_suffix", DOC + ids(1, 4), sampled),
            request("next_turn", warm_prompt + tuple(warm_output) + ids(20, 5), sampled)]


def warm_request(sampled: bool) -> EngineRequest:
    return request("warm", DOC + ids(60, 2), sampled)


_EXPECTED: dict[tuple, tuple] = {}


def expected(kv: str, k: int, sampled: bool) -> tuple[list[int], dict[str, dict]]:
    """The warm request's tokens and each hit request served alone on a C = 1 engine with the cache off."""
    key = (kv, k, sampled)
    if key not in _EXPECTED:
        off = local_engine(MODEL, options(kv, k, caching=False))
        warm = serve_in_turn(off, [warm_request(sampled)])["warm"]["tokens"]
        alone = {}
        for req in hit_requests(sampled, warm):
            alone.update(serve_in_turn(local_engine(MODEL, options(kv, k, caching=False)), [req]))
        _EXPECTED[key] = warm, alone
    return _EXPECTED[key]


def check_hits(served: dict[str, dict], alone: dict[str, dict], k: int) -> None:
    # with speculation the last page before the questions differ is not reused: its MTP row read the next token
    doc_hit = 320 if k == 0 else 256
    assert served["long_suffix"]["cached"] == doc_hit and served["short_suffix"]["cached"] == doc_hit
    assert served["next_turn"]["cached"] == 384  # the prompt's and the answer's pages (380 + 4 positions)
    for name, result in alone.items():
        assert result["cached"] == 0
        got = served[name]
        assert (got["tokens"], got["logprobs"]) == (result["tokens"], result["logprobs"]), name
        if k:
            assert (got["first_draft"], got["accepted"]) == (result["first_draft"], result["accepted"]), name


@pytest.mark.parametrize("kv, k, sampled", [("auto", 0, False), ("auto", 2, True), ("fp8_e4m3", 2, False),
                                            ("fp8_e4m3", 0, True)])
def test_c1_a_hit_gives_the_bits_of_an_uncached_run(kv, k, sampled):
    warm, alone = expected(kv, k, sampled)
    engine = local_engine(MODEL, options(kv, k, caching=True, budget=128))  # chunked: hits land mid prompt too
    served = serve_in_turn(engine, [warm_request(sampled), *hit_requests(sampled, warm)])
    assert served["warm"]["tokens"] == warm
    check_hits(served, alone, k)


@pytest.fixture(scope="module")
def groups():
    """C = 2 groups loaded deterministic: EP = 1 with FP8 KV, EP = 2 with bf16 KV."""
    start_ray(min_cpus=2 * engine_cpus(2))
    layouts = {(1, "fp8_e4m3"), (2, "auto")}
    launched = {(ep, kv): launch_group(MODEL, ResolvedCPConfig(True, 2, "zigzag", "legacy", ep_size=ep), DTYPE,
                                       NUM_PAGES, PAGE_SIZE, kv_cache_dtype=kv, deterministic=True)
                for ep, kv in layouts}
    yield launched
    for group in launched.values():
        group.shutdown()
    import ray

    ray.shutdown()


@pytest.mark.parametrize("strategy, impl, ep, kv, k, sampled", [
    ("zigzag", "legacy", 1, "fp8_e4m3", 2, False), ("interleave", "v2", 1, "fp8_e4m3", 0, True),
    ("zigzag", "v2", 2, "auto", 2, True), ("interleave", "legacy", 2, "auto", 0, False)])
def test_c2_hits_on_both_ranks_or_one_give_the_bits_of_an_uncached_c1_run(groups, strategy, impl, ep, kv, k,
                                                                         sampled):
    warm, alone = expected(kv, k, sampled)
    cp = ResolvedCPConfig(True, 2, strategy, impl, ep_size=ep)
    spec = resolve_engine_spec(MODEL, cp, options(kv, k, caching=True))
    engine = engine_over_workers(spec, groups[(ep, kv)].workers)
    pieces = []
    engine.add_step_observer(lambda step, results: pieces.append(step.prefill) if step.prefill else None)
    served = serve_in_turn(engine, [warm_request(sampled), *hit_requests(sampled, warm)])
    assert served["warm"]["tokens"] == warm
    check_hits(served, alone, k)
    kinds = {p.request_id: batch.cp for batch in pieces for p in batch.pieces if p.prefix_len == (256 if k else 320)}
    assert kinds["long_suffix"] and kinds["short_suffix"] == (k > 0)  # 1 new token (k = 0) runs on one rank
    asyncio.run(engine.drain())


def test_disabled_cache_reports_no_cached_tokens():
    engine = local_engine(MODEL, replace(options("auto", 0, caching=False)))
    served = serve_in_turn(engine, [warm_request(False), warm_request(False)])
    assert served["warm"]["cached"] == 0 and engine.scheduler.cached_pages() == [0]
