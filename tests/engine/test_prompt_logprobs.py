"""Prompt logprobs at C = 1 against the `transformers` reference: the log-softmax of every prompt token given the
tokens before it, with its top alternatives and rank, across prefill chunks (a prompt longer than the token
budget), delivered once on the first chunk of each stream, also when preemption makes the engine recompute; and
for DeepSeek-V4 (its own cache and model, the same prefill)."""

import asyncio

import pytest

from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineChunk, EngineRequest
from cp_router.request_state import RequestState
from support.cp_cluster import make_prompts
from support.engines import local_engine
from support.tiny_models import reference_logprobs

CHUNK = 16  # prefill tokens per step: a 40-token prompt runs as chunks 16 + 16 + 8


@pytest.fixture(scope="module")
def model(reference_checkpoint):
    return reference_checkpoint("v32", mtp=True)


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory):
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    target, _, folder = v4_checkpoint_with_mtp(tmp_path_factory.mktemp("v4_mtp"))
    return target, folder


def streams_of(engine, requests: list[EngineRequest]) -> list[list[EngineChunk]]:
    """Every chunk of every request, run concurrently."""
    async def chunks_of(request):
        return [chunk async for chunk in engine.generate(request)]

    async def main():
        return await asyncio.gather(*[chunks_of(r) for r in requests])

    return asyncio.run(main())


def check_against_reference(ref, request: EngineRequest, chunks: list[EngineChunk]) -> None:
    """One prompt_logprobs list, on the first chunk, equal to the reference's within 1e-4."""
    assert [chunk.prompt_logprobs is not None for chunk in chunks] == [True] + [False] * (len(chunks) - 1)
    ours, prompt = chunks[0].prompt_logprobs, list(request.prompt_token_ids)
    assert len(ours) == len(prompt) and ours[0] is None
    expected = reference_logprobs(ref, prompt[:1], prompt[1:], request.prompt_logprobs)
    for position, (lp, (value, rank, top_ids, top_values)) in enumerate(zip(ours[1:], expected, strict=True), 1):
        assert lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(value, abs=1e-4)
        assert lp.rank == rank
        assert [t for t, _ in lp.top] == top_ids
        assert [v for _, v in lp.top] == pytest.approx(top_values, abs=1e-4)


class PrefixWatch:
    """Step observer: the cached prefixes of the prefill pieces that ran."""

    def __init__(self):
        self.prefixes: set[int] = set()

    def __call__(self, step, results) -> None:
        if step.prefill is not None:
            self.prefixes |= {p.prefix_len for p in step.prefill.pieces}


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_across_chunks_equal_the_reference(model, k):
    ref, folder = model
    engine = local_engine(folder, EngineOptions(num_speculative_steps=k, num_pages=64, page_size=8,
                                                prefill_token_budget=CHUNK))
    watch = PrefixWatch()
    engine.add_step_observer(watch)
    prompts = make_prompts([40, 9, 1, 23], seed=21)
    tops = [3, 0, 2, 5]
    requests = [EngineRequest(f"p{i}", tuple(p), 4, temperature=0.0, ignore_eos=True, prompt_logprobs=top)
                for i, (p, top) in enumerate(zip(prompts, tops))]
    plain = EngineRequest("plain", tuple(prompts[0]), 4, temperature=0.0, ignore_eos=True)
    *asked, not_asked = streams_of(engine, requests + [plain])
    for request, chunks in zip(requests, asked):
        check_against_reference(ref, request, chunks)
    assert [t for c in asked[0] for t in c.token_ids] == [t for c in not_asked for t in c.token_ids]
    assert all(chunk.prompt_logprobs is None for chunk in not_asked)
    assert {16, 32} <= watch.prefixes  # the 40-token prompt was prefilled in chunks with a cached prefix
    assert engine.free_pages == [64]


def test_preempted_requests_deliver_prompt_logprobs_once(model, monkeypatch):
    """Preempted while decoding (recomputed without scoring the prompt again) and while its prompt was still
    being prefilled in chunks (scored again from the start): every stream gets one right list."""
    ref, folder = model
    victims = []
    reset = RequestState.reset_for_recompute

    def spy(self):
        victims.append(self.status)
        reset(self)

    monkeypatch.setattr(RequestState, "reset_for_recompute", spy)
    engine = local_engine(folder, EngineOptions(num_pages=9, page_size=8, prefill_token_budget=CHUNK))
    recomputed = []  # prefill requests that fold output tokens into the context (decoding victims)
    engine.add_step_observer(lambda step, results: recomputed.extend(
        req for plan in step.plans.values() if plan.prefill for req in plan.prefill.requests if req.num_generated))
    prompts = make_prompts([40, 30, 20, 35, 12, 26], seed=23)
    requests = [EngineRequest(f"q{i}", tuple(p), 24, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
                for i, p in enumerate(prompts)]
    for request, chunks in zip(requests, streams_of(engine, requests)):
        check_against_reference(ref, request, chunks)
        assert sum(len(c.token_ids) for c in chunks) == 24
    assert engine.stats.preemptions > 0 and set(victims) == {"prefilling", "decoding"}
    assert recomputed and not any(req.prompt_logprobs is not None for req in recomputed)  # scored once only
    assert engine.free_pages == [9]


def test_v4_prompt_logprobs_equal_the_reference(v4_model):
    ref, folder = v4_model
    engine = local_engine(folder, EngineOptions(num_speculative_steps=1, num_pages=16, page_size=16,
                                                prefill_token_budget=CHUNK))
    prompts = make_prompts([40, 7], seed=31)
    requests = [EngineRequest(f"v{i}", tuple(p), 3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
                for i, p in enumerate(prompts)]
    for request, chunks in zip(requests, streams_of(engine, requests)):
        check_against_reference(ref, request, chunks)
