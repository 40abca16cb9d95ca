"""The served engine against the `transformers` reference and against itself across CP sizes, on a real C = 2
group (local Ray + gloo): greedy tokens under CP v2 with chunked prefill (a prefix > 0) and speculation, for
both strategies and both DSA families, and for DeepSeek-V4 (interleave, MTP k = 0 / 3, and k = 2 under EP = 2);
logprob values against the reference's log-softmax at k = 0 / 2 and C = 1 / 2, and prompt logprobs of a prompt
prefilled in chunks split over both ranks; seeded sampling at T > 0 with speculation, equal at C = 2 and C = 1
(V3.2 and V4)."""

import asyncio

import pytest
import torch

from cluster.engine_setup import run_all
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from support.cp_cluster import make_prompts, ray_groups
from support.engines import local_engine
from support.tiny_models import reference_logprobs

CHUNK = 16  # prefill tokens per step: the 40-token prompt runs as chunks 16 + 16 + 8 (prefixes 16 and 32)


@pytest.fixture(scope="module")
def cluster():
    with ray_groups([2]) as groups:
        yield groups


@pytest.fixture(scope="module")
def models(reference_checkpoint, tmp_path_factory):
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    target, _, v4_folder = v4_checkpoint_with_mtp(tmp_path_factory.mktemp("v4_mtp"))
    return {"v32": reference_checkpoint("v32", mtp=True), "glm": reference_checkpoint("glm_shared", mtp=True),
            "v4": (target, v4_folder)}


def reference_greedy(ref, ids: list[int], count: int, **generate_options) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, pad_token_id=0,
                       **generate_options)
    return out[0, len(ids):].tolist()


async def chunks_of(engine, request: EngineRequest) -> list:
    """Every chunk of one request's stream."""
    return [chunk async for chunk in engine.generate(request)]


class ChunkWatch:
    """Step observer: the prefill pieces that ran under CP with a cached prefix, and the requests prefilled whole
    by their owners (no CP)."""

    def __init__(self):
        self.prefixes: list[int] = []
        self.by_owner: list[str] = []

    def __call__(self, step, results) -> None:
        if step.prefill is not None and step.prefill.cp:
            self.prefixes += [p.prefix_len for p in step.prefill.pieces if p.prefix_len > 0]
        elif step.prefill is not None:
            self.by_owner += [p.request_id for p in step.prefill.pieces]


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
@pytest.mark.parametrize("model", ["v32", "glm"])
def test_cp_v2_chunked_prefill_with_speculation_matches_transformers(cluster, models, model, strategy):
    ref, folder = models[model]
    engine = cluster.engine(2, folder, strategy, "v2", prefill_token_budget=CHUNK, num_speculative_steps=2,
                            return_logits=False)
    watch = ChunkWatch()
    engine.add_step_observer(watch)
    prompts = make_prompts([40, 23, 9], seed=11)
    requests = [EngineRequest(f"c{i}", tuple(p), 10, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, run_all(engine, requests)):
        assert result["token_ids"] == reference_greedy(ref, prompt, 10)
    assert 16 in watch.prefixes and 32 in watch.prefixes  # chunks with a cached prefix ran split over both ranks


def test_repetition_penalty_under_cp_chunking_and_speculation_matches_transformers(cluster, models):
    """transformers' RepetitionPenaltyLogitsProcessor is the oracle: the prompt crosses chunks split over both
    ranks, every rank samples the prefill token with the request's history, the owner keeps it for decode."""
    ref, folder = models["v32"]
    engine = cluster.engine(2, folder, "interleave", "v2", prefill_token_budget=CHUNK, num_speculative_steps=2,
                            return_logits=False)
    prompts = make_prompts([40, 9], seed=13)
    requests = [EngineRequest(f"r{i}", tuple(p), 12, temperature=0.0, ignore_eos=True, repetition_penalty=1.6)
                for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, run_all(engine, requests)):
        assert result["token_ids"] == reference_greedy(ref, prompt, 12, repetition_penalty=1.6)
        assert result["token_ids"] != reference_greedy(ref, prompt, 12)  # the penalty changed the tokens


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("k", [0, 2])
def test_logprob_values_equal_the_reference_log_softmax(cluster, models, cp_size, k):
    ref, folder = models["v32"]
    if cp_size == 1:
        engine = local_engine(folder, EngineOptions(num_speculative_steps=k, num_pages=64, page_size=8))
    else:
        engine = cluster.engine(2, folder, "zigzag", "legacy", num_speculative_steps=k, return_logits=False)
    prompts = make_prompts([21, 7], seed=13)
    requests = [EngineRequest(f"l{i}", tuple(p), 8, temperature=0.0, ignore_eos=True, logprobs=3)
                for i, p in enumerate(prompts)]

    async def streams():
        return await asyncio.gather(*[chunks_of(engine, r) for r in requests])

    for prompt, chunks in zip(prompts, asyncio.run(streams())):
        tokens = [t for c in chunks for t in c.token_ids]
        ours = [lp for c in chunks for lp in c.logprobs]
        for lp, (value, rank, top_ids, top_values) in zip(ours, reference_logprobs(ref, prompt, tokens, 3),
                                                          strict=True):
            assert lp.logprob == pytest.approx(value, abs=1e-4) and lp.rank == rank
            assert [t for t, _ in lp.top] == top_ids
            assert [v for _, v in lp.top] == pytest.approx(top_values, abs=1e-4)


@pytest.mark.parametrize("cp_min", [0, 10_000])  # 10_000: whole prompts are prefilled by their owners alone
def test_prompt_logprobs_of_chunks_split_over_two_ranks_equal_the_reference(cluster, models, cp_min):
    """Every rank holds the gathered hidden states; the owner scores each chunk's rows (the last row of a
    non-final chunk against the next chunk's first token) and the engine joins the chunks in order."""
    ref, folder = models["v32"]
    engine = cluster.engine(2, folder, "interleave", "v2", prefill_token_budget=CHUNK, return_logits=False,
                            cp_min_prefill_tokens=cp_min)
    watch = ChunkWatch()
    engine.add_step_observer(watch)
    prompts = make_prompts([40, 23, 9, 6, 7], seed=29)
    requests = [EngineRequest(f"p{i}", tuple(p), 3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
                for i, p in enumerate(prompts)]

    async def first_chunks():
        streams = await asyncio.gather(*[chunks_of(engine, r) for r in requests])
        return [chunks[0] for chunks in streams]

    for prompt, first in zip(prompts, asyncio.run(first_chunks())):
        ours = first.prompt_logprobs
        assert len(ours) == len(prompt) and ours[0] is None
        expected = reference_logprobs(ref, prompt[:1], prompt[1:], 2)
        for lp, token, (value, rank, top_ids, top_values) in zip(ours[1:], prompt[1:], expected, strict=True):
            assert lp.token_id == token and lp.rank == rank and [t for t, _ in lp.top] == top_ids
            assert lp.logprob == pytest.approx(value, abs=1e-4)
            assert [v for _, v in lp.top] == pytest.approx(top_values, abs=1e-4)
    assert 16 in watch.prefixes and 32 in watch.prefixes  # chunks with a cached prefix ran split over both ranks
    assert bool(watch.by_owner) == bool(cp_min)


@pytest.mark.parametrize("model", ["v32", "v4"])
def test_seeded_sampling_with_speculation_is_equal_at_c2_and_c1(cluster, models, model):
    _, folder = models[model]
    prompts = make_prompts([30, 12, 5, 19], seed=17)
    penalties = [{}, dict(presence_penalty=0.7, frequency_penalty=0.4), dict(repetition_penalty=1.3, min_p=0.05), {}]
    requests = [EngineRequest(f"t{i}", tuple(p), 16, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True,
                              **penalties[i]) for i, p in enumerate(prompts)]
    alone = run_all(local_engine(folder, EngineOptions(num_speculative_steps=2, num_pages=64, page_size=8)), requests)
    for cp_min in (0, 10_000):  # 10_000: each prompt prefilled whole by its owner, the two ranks side by side
        grouped = run_all(cluster.engine(2, folder, "interleave", "v2", num_speculative_steps=2, return_logits=False,
                                         cp_min_prefill_tokens=cp_min), requests)
        assert [r["token_ids"] for r in grouped] == [r["token_ids"] for r in alone], f"cp_min={cp_min}"
    assert len({tuple(r["token_ids"]) for r in alone}) == len(requests)  # sampled, not one greedy path


@pytest.mark.parametrize(("k", "ep_size"), [(0, 1), (3, 1), (2, 2)])
def test_v4_at_c2_with_chunked_prefill_and_mtp_matches_transformers(cluster, models, k, ep_size):
    """DeepSeek-V4 on a C = 2 group: prompt chunks with a cached prefix run split over both ranks (interleave
    v2), then MTP speculation at the owner (under EP = 2: in lockstep); greedy tokens equal transformers."""
    target, folder = models["v4"]
    engine = cluster.engine(2, folder, "interleave", "v2", prefill_token_budget=CHUNK, num_speculative_steps=k,
                            return_logits=False, ep_size=ep_size)
    watch = ChunkWatch()
    engine.add_step_observer(watch)
    prompts = make_prompts([40, 23, 9], seed=19)
    requests = [EngineRequest(f"v{i}", tuple(p), 12, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, run_all(engine, requests)):
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        assert result["token_ids"] == out[0, len(prompt):].tolist()
    assert 16 in watch.prefixes and 32 in watch.prefixes



@pytest.mark.parametrize("model, cp_size, k", [("v32", 2, 2), ("glm", 2, 0), ("glm", 1, 2), ("v4", 1, 0), ("v4", 1, 2),
                                               ("v4", 2, 1)])
def test_greedy_tokens_after_a_prefix_cache_hit_equal_transformers(cluster, models, model, cp_size, k):
    """A document and a question; then the document with another question and the chat's next turn, each after
    the one before ended: they start at a cached prefix (DeepSeek-V4: at a snapshot of its window and compressor
    state) and still decode transformers' greedy tokens."""
    ref, folder = models[model]
    settings = dict(prefill_token_budget=CHUNK, num_speculative_steps=k, enable_prefix_caching=True)
    engine = cluster.engine(2, folder, "zigzag", "v2", return_logits=False, **settings) if cp_size == 2 else \
        local_engine(folder, EngineOptions(num_pages=64, page_size=8, **settings))
    doc, first_q, other_q, turn = make_prompts([40, 6, 5, 4], seed=23)
    first = doc + first_q
    answer = asyncio.run(greedy_after_cache(engine, "first", first))[0]
    assert answer == reference_greedy(ref, first, 8, eos_token_id=None)
    for name, prompt in (("other", doc + other_q), ("turn", first + answer + turn)):
        tokens, cached = asyncio.run(greedy_after_cache(engine, name, prompt))
        assert cached >= (40 if k == 0 else 32), name  # with speculation page 5's MTP row read the question
        assert tokens == reference_greedy(ref, prompt, 8, eos_token_id=None), name
    asyncio.run(engine.drain())


async def greedy_after_cache(engine, name: str, prompt: list[int]) -> tuple[list[int], int]:
    chunks = await chunks_of(engine, EngineRequest(name, tuple(prompt), 8, temperature=0.0, ignore_eos=True))
    return [t for c in chunks for t in c.token_ids], chunks[-1].cached_tokens
