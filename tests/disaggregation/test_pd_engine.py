"""Prefill/decode disaggregation between two engines in this process (C = 1 each; cp_router/disaggregated.py):
with --enable-deterministic-inference every request's tokens and logprobs are bit-identical to one colocated engine's,
greedy and seeded, k = 0 and k = 2, bf16 and FP8 KV, alone and 6 at once; both sides' pages all come back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.engine_spec import EngineOptions
from cp_router.disaggregated import DisaggregatedEngine
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine

MODEL = resolve_model_dir(None)


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, 6144, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def outcomes(engine, batch: list[EngineRequest]) -> dict[str, tuple]:
    """Per request, all at once: tokens, (logprob, top) per token, text, completion tokens and finish reason."""
    return asyncio.run(outcomes_of(engine, batch))


async def outcomes_of(engine, batch: list[EngineRequest]) -> dict[str, tuple]:
    async def one(request):
        chunks = [chunk async for chunk in engine.generate(request)]
        return ([t for c in chunks for t in c.token_ids], [(lp.logprob, lp.top) for c in chunks for lp in c.logprobs],
                "".join(c.text for c in chunks), chunks[-1].completion_tokens, chunks[-1].finish_reason)

    return dict(zip([r.request_id for r in batch], await asyncio.gather(*[one(r) for r in batch])))


def options(**overrides) -> EngineOptions:
    return EngineOptions(**{**dict(dtype="bfloat16", num_pages=64, page_size=32, deterministic=True), **overrides})


def requests() -> list[EngineRequest]:
    """Greedy and seeded, with logprobs and penalties, prompts of 5..300 tokens (several pages, one partly full)."""
    return [EngineRequest(f"r{i}", prompt(5 + 59 * i, i), 9, temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                          ignore_eos=True, logprobs=2, repetition_penalty=1.3 if i == 3 else 1.0) for i in range(6)]


def pd_pair(**overrides) -> tuple[DisaggregatedEngine, object, object]:
    prefill, decode = local_engine(MODEL, options(**overrides)), local_engine(MODEL, options(**overrides))
    return DisaggregatedEngine(decode, prefill), prefill, decode


@pytest.mark.parametrize("k,kv", [(0, "auto"), (2, "auto"), (2, "fp8_e4m3")])
def test_pd_is_bit_identical_to_colocated(k, kv):
    engine = local_engine(MODEL, options(num_speculative_steps=k, kv_cache_dtype=kv))
    colocated = outcomes(engine, requests())
    pd, prefill, decode = pd_pair(num_speculative_steps=k, kv_cache_dtype=kv)
    together = outcomes(pd, requests())
    assert together == colocated
    # The draft state moved with the pages: every verify accepts what it accepted colocated (drafts never
    # change tokens, so only these counts show a wrong draft hidden state or MTP KV).
    assert decode.stats.accepted_per_position == engine.stats.accepted_per_position
    assert decode.stats.drafted == engine.stats.drafted
    alone = {r.request_id: outcomes(pd, [r])[r.request_id] for r in requests()[:2]}
    assert alone == {rid: colocated[rid] for rid in alone}
    assert pd.stats["handoffs"] == 6 + 2 and pd.stats["local_prefills"] == 0
    asyncio.run(prefill.drain()), asyncio.run(decode.drain())
    for side in (prefill, decode):  # every page back (free or cached), nothing held by a rank
        assert side.scheduler.free_pages() == [64] and not side.scheduler.requests
        assert side.workers[0].worker.held == {}
