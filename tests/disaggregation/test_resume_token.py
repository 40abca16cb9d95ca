"""Re-prefill after a failure (a lost rank, a hand-off that has to be redone) resumes a request whose last output
token was streamed already: its final prefill chunk takes that token (`resume_token`) instead of sampling one, and
decoding goes on from it. Checked at the worker level with a resume token the logits do not favour (greedy picks
another), with and without speculation: nothing is emitted twice, the rank holds the token as the pending one, and
the tokens that follow are those of a request whose prompt ends with it."""

from __future__ import annotations

import pytest
import torch

from cluster.engine_spec import EngineOptions
from cp_router.sampling import SamplingParams
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine

MODEL = resolve_model_dir(None)
PROMPT = tuple(torch.randint(1, 6144, (45,), generator=torch.Generator().manual_seed(3)).tolist())
GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, repetition_penalty=1.2)


def engine_of(k: int):
    return local_engine(MODEL, EngineOptions(dtype="bfloat16", num_pages=32, page_size=16, deterministic=True,
                                             num_speculative_steps=k))


def run_steps(engine, request_id: str) -> tuple[list[list[int]], int]:
    """Steps the request to its end through the scheduler and the in-process rank: its new tokens per step, and the
    token its first (prefill) step reported."""
    scheduler, worker, emitted, first = engine.scheduler, engine.workers[0].worker, [], None
    while request_id in scheduler.requests:
        step = scheduler.schedule()
        result = worker.step(step.plans[0])
        out = result.outputs[request_id]
        first = out.token_id if first is None else first
        emitted.append(scheduler.apply(step, result.outputs)[request_id])
        if out.finish_reason is not None:
            scheduler.finish(request_id)
    return emitted, first


@pytest.mark.parametrize("k", [0, 2])
def test_a_resumed_prefill_continues_from_the_streamed_token(k):
    engine = engine_of(k)
    engine.scheduler.add("fresh", list(PROMPT), GREEDY)
    fresh, greedy_first = run_steps(engine, "fresh")
    resume = (greedy_first + 17) % 6144  # a token greedy decoding does not pick here
    engine.scheduler.add("resumed", list(PROMPT), GREEDY)
    seq = engine.scheduler.requests["resumed"]
    seq.output_ids = [resume]  # streamed before the failure
    seq.reset_for_recompute()
    resumed, first = run_steps(engine, "resumed")
    assert first == resume and resumed[0] == []  # the prefill takes the streamed token and emits nothing
    engine.scheduler.add("reference", list(PROMPT) + [resume], GREEDY)  # the prompt ending with that token
    reference, _ = run_steps(engine, "reference")
    continuation = [t for tokens in resumed for t in tokens]
    assert continuation == [t for tokens in reference for t in tokens][: len(continuation)]
    assert len(continuation) == GREEDY.max_tokens - 1 and continuation != [t for ts in fresh for t in ts][1:]
