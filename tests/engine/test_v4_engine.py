"""DeepSeek-V4 served by the engine (C = 1, in process) from a release-named checkpoint with an MTP block: greedy
tokens equal `transformers` with speculation off and with k = 1, 2, 3 MTP drafts (chunked prefill on)."""

import asyncio

import pytest
import torch

from cluster.engine_setup import run_all
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from support.engines import local_engine
from support.v4_checkpoints import v4_checkpoint_with_mtp


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory):
    return v4_checkpoint_with_mtp(tmp_path_factory.mktemp("v4_mtp"))


def reference_greedy(target, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_greedy_with_and_without_mtp_speculation_equals_transformers(v4_model, k):
    target, _, folder = v4_model
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 9, 17)]
    engine = local_engine(folder, EngineOptions(num_speculative_steps=k, num_pages=16, page_size=16,
                                                prefill_token_budget=16))
    requests = [EngineRequest(f"v{i}", tuple(p), 24, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, run_all(engine, requests)):
        assert result["token_ids"] == reference_greedy(target, prompt, 24)


def test_preemption_with_recompute_and_speculation_keeps_greedy_tokens(v4_model):
    """Too few pages for all requests: the newest is preempted, its state dropped with its pages, and its
    prompt + output recomputed from position 0 later; tokens still equal transformers'."""
    target, _, folder = v4_model
    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 17, 9, 21)]
    engine = local_engine(folder, EngineOptions(num_speculative_steps=2, num_pages=6, page_size=16,
                                                prefill_token_budget=32))
    requests = [EngineRequest(f"p{i}", tuple(p), 24, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, run_all(engine, requests)):
        assert result["token_ids"] == reference_greedy(target, prompt, 24)
    assert engine.stats.preemptions > 0 and engine.free_pages == [6]
    asyncio.run(engine.drain())  # the rank's frees wait for a next request's step; drain sends them now
    assert engine.workers[0].worker.runner.cache.states == {}  # every request's state released
