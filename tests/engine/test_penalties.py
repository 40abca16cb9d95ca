"""Sampling options that change the target's logits (repetition / presence / frequency penalties, logit_bias,
min_p): their math against a hand-written reference and transformers' own processor, and in the engine:
greedy speculation equals plain decoding with them, and a recomputed (preempted) request keeps its history."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from cluster.engine_setup import run_all
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from cp_router.sampling import SamplingParams
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.logits_processing import TokenHistory, process_logits
from model_workers.sampler import target_probs
from support.engines import local_engine, make_requests

PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8), dict(frequency_penalty=0.6),
             dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((7, 5.0),))]


def test_penalties_follow_vllm_semantics_and_transformers_repetition_processor():
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    context, generated = (3, 9, 9, 4, 12, 12, 12), 4  # prompt 3, 9, 9; output 4, 12, 12, 12
    history = TokenHistory.of(context, generated, 50)
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias=((20, -3.0), (21, 2.5)))
    want = logits.clone()
    want[[20, 21]] += torch.tensor([-3.0, 2.5])
    hf = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([context]), want[None].clone())[0]
    want = hf.clone()
    for token, count in {4: 1, 12: 3}.items():
        want[token] -= 0.25 * count + 0.5
    assert torch.allclose(process_logits(logits, params, history), want)
    assert torch.equal(process_logits(logits, SamplingParams(), None), logits)  # nothing to apply: the same tensor


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.4), [])
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)  # 0.15 < 0.4 x 0.5


@pytest.fixture(scope="module")
def default_model():
    return resolve_model_dir(None)


def options(k: int, num_pages: int = 96) -> EngineOptions:
    return EngineOptions(num_speculative_steps=k, num_pages=num_pages, page_size=8, prefill_token_budget=32)


def with_options(requests: list[EngineRequest], extra: dict) -> list[EngineRequest]:
    return [EngineRequest(**{**r.__dict__, "temperature": 0.0, **extra}) for r in requests]


@pytest.mark.parametrize("extra", PENALTIES, ids=lambda e: ",".join(e))
def test_speculation_with_penalties_equals_plain_decoding(default_model, extra):
    base = make_requests([3, 17, 45], 20, 6000, prompt_seed=1, ignore_eos=True)
    requests = with_options(base, extra)
    plain = run_all(local_engine(default_model, options(0)), requests)
    assert plain != run_all(local_engine(default_model, options(0)), with_options(base, {}))  # the option acts
    for k in (1, 3):
        engine = local_engine(default_model, options(k))
        assert run_all(engine, requests) == plain, f"k={k}"
        assert engine.stats.drafted > engine.stats.accepted > 0


def test_penalties_survive_preemption_and_chunked_prefill(default_model):
    lens = [1 + (i * 37) % 60 for i in range(12)]
    requests = with_options(make_requests(lens, [6 + i % 5 for i in range(12)], 6000, prompt_seed=2,
                                          ignore_eos=True), dict(repetition_penalty=1.4, frequency_penalty=0.5))
    lone = local_engine(default_model, options(0))
    alone = [run_all(lone, [req])[0]["token_ids"] for req in requests]
    small = local_engine(default_model, options(2, num_pages=10))  # 80 token slots: forces preemption
    assert [r["token_ids"] for r in run_all(small, requests)] == alone
    assert small.stats.preemptions > 0


def test_seeded_sampling_with_penalties_and_min_p_is_reproducible_whatever_the_batch(default_model):
    extra = dict(temperature=0.8, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.4, seed=11)
    (target,) = with_options(make_requests([12], 16, 6000, prompt_seed=3), extra)
    others = make_requests([5, 30, 9], 10, 6000, prompt_seed=4, temperature=1.0)
    engine = local_engine(default_model, options(2))
    alone = run_all(engine, [target])[0]["token_ids"]
    crowded = run_all(engine, others + [EngineRequest(**{**target.__dict__, "request_id": "again"})])[-1]
    assert crowded["token_ids"] == alone
    plain = run_all(local_engine(default_model, options(2)), with_options([target], {**extra, "min_p": 0.0,
                                                                                     "repetition_penalty": 1.0,
                                                                                     "presence_penalty": 0.0}))
    assert plain[0]["token_ids"] != alone  # the options change what is sampled
