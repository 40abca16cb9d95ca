"""The engine at C = 1 in this process (the rank worker without Ray): lossless speculation, continuous batching
with chunked prefill, stop strings and preemption, seeded sampling, logprobs, abort."""

import asyncio
import json
import shutil

import pytest

from cluster.engine_setup import collect, run_all
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from model_workers.models.dsa.backend import DSABackend
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine, make_requests

PAGE_SIZE = 8
BUDGET = 32  # prefill tokens per step: prompts of 33+ tokens are chunked


def options(k: int = 0, num_pages: int = 128, **kwargs) -> EngineOptions:
    return EngineOptions(num_speculative_steps=k, num_pages=num_pages, page_size=PAGE_SIZE,
                         prefill_token_budget=BUDGET, **kwargs)


@pytest.fixture(scope="module")
def random_mtp(reference_checkpoint):
    return reference_checkpoint("v32", mtp=True)[1]


@pytest.fixture(scope="module")
def default_model():
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def models(random_mtp, default_model):
    return {"random_mtp": random_mtp, "default": default_model}


@pytest.mark.parametrize("model,temperature", [("random_mtp", 0.0), ("default", 0.0), ("default", 0.9)])
def test_speculation_equals_plain_decoding_greedy_and_seeded(models, model, temperature):
    requests = make_requests([3, 17, 45], 14, 120, prompt_seed=1, temperature=temperature, ignore_eos=True, seed=5)
    plain = run_all(local_engine(models[model], options(0)), requests)
    for k in (1, 2, 3):
        engine = local_engine(models[model], options(k))
        assert run_all(engine, requests) == plain, f"k={k}"
        assert engine.stats.drafted > 0 and engine.stats.accepted < engine.stats.drafted  # rejections happened
        if model == "default":
            assert engine.stats.accepted > 0  # trained MTP layer: acceptances happened
        assert engine.free_pages == [128]


def with_stops(requests: list[EngineRequest], alone: list[dict]) -> tuple[list[EngineRequest], list[str]]:
    """Every 4th request gets a stop string taken from the middle of its text alone; expected texts."""
    stopped, expected = [], []
    for i, (req, out) in enumerate(zip(requests, alone)):
        text = out["text"]
        if i % 4 == 0 and len(text) >= 6:
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            req = EngineRequest(**{**req.__dict__, "stop": (stop,)})
            text = text[: text.find(stop)]
        stopped.append(req)
        expected.append(text)
    return stopped, expected


def check_same_as_alone(results: list[dict], alone: list[dict], expected_texts: list[str], requests) -> None:
    for out, ref, text, req in zip(results, alone, expected_texts, requests):
        assert out["text"] == text, req.request_id
        if req.stop:
            assert out["finish_reason"] == "stop" and out["token_ids"] == ref["token_ids"][: len(out["token_ids"])]
        else:
            assert out["token_ids"] == ref["token_ids"], req.request_id


def test_64_concurrent_requests_match_their_runs_alone(default_model):
    lens = [1 + (i * 37) % 60 for i in range(64)]  # up to 60 tokens: many longer than the budget (chunked)
    requests = make_requests(lens, [2 + i % 6 for i in range(64)], 6000, prompt_seed=2, temperature=0.0, ignore_eos=True)
    lone = local_engine(default_model, options(0))
    alone = [run_all(lone, [req])[0] for req in requests]
    requests, expected = with_stops(requests, alone)
    engine = local_engine(default_model, options(2))
    check_same_as_alone(run_all(engine, requests), alone, expected, requests)
    assert engine.free_pages == [128] and not engine.scheduler.requests
    small = local_engine(default_model, options(2, num_pages=14))  # 112 token slots: forces preemption
    check_same_as_alone(run_all(small, requests), alone, expected, requests)
    assert small.stats.preemptions > 0 and small.free_pages == [14]


def test_seeded_sampling_is_reproducible_whatever_the_batch(default_model):
    (target,) = make_requests([12], 12, 6000, prompt_seed=3, temperature=0.9, top_p=0.95, seed=11)
    others = make_requests([5, 30, 9], 10, 6000, prompt_seed=4, temperature=1.0)
    engine = local_engine(default_model, options(2))
    alone = run_all(engine, [target])[0]
    crowded = run_all(engine, others + [EngineRequest(**{**target.__dict__, "request_id": "again"})])[-1]
    assert crowded["token_ids"] == alone["token_ids"]
    reseeded = run_all(engine, [EngineRequest(**{**target.__dict__, "seed": 12})])[0]
    assert reseeded["token_ids"] != alone["token_ids"]


def test_logprobs_of_chosen_tokens(default_model):
    (req,) = make_requests([10], 6, 6000, prompt_seed=5, temperature=0.0, logprobs=2)
    engine = local_engine(default_model, options(2))

    async def chunks():
        return [c async for c in engine.generate(req)]

    got = asyncio.run(chunks())
    logprobs = [lp for c in got for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for c in got for t in c.token_ids] and len(logprobs) == 6
    for lp in logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])
    assert got[-1].completion_tokens == 6 and got[-1].finish_reason == "length"


def test_abort_frees_pages_at_once(default_model):
    (req,) = make_requests([40], 200, 6000, prompt_seed=6, temperature=0.0, ignore_eos=True)
    engine = local_engine(default_model, options(1))

    async def scenario():
        stream = engine.generate(req)
        first = await stream.__anext__()
        await engine.abort(req.request_id)
        rest = [c async for c in stream]
        assert engine.free_pages == [128]  # at once; the rank's own state goes with the next step
        await engine.drain()  # no request comes: drain sends the free now
        return first, rest

    first, rest = asyncio.run(scenario())
    assert first.token_ids and rest[-1].finish_reason == "abort"
    assert engine.free_pages == [128] and not engine.scheduler.has_work()


def test_too_long_request_is_refused_with_its_sizes(default_model):
    engine = local_engine(default_model, options(0, num_pages=4))
    (req,) = make_requests([40], 20, 6000)
    with pytest.raises(ValueError, match="needs 8 KV pages; a rank has 4"):
        asyncio.run(collect(engine, req))


@pytest.fixture(scope="module")
def shared_index_model(random_mtp, tmp_path_factory):
    """The random-MTP checkpoint with MTP index sharing configured (GLM-5.2 style)."""
    folder = tmp_path_factory.mktemp("v32_mtp_share")
    for path in random_mtp.iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "index_share_for_mtp_iteration": True}))
    return folder


def test_mtp_index_sharing_reuses_topk_and_stays_lossless(shared_index_model, monkeypatch):
    reused = []
    select = DSABackend.select_topk

    def spy(self, layer_id, *args):
        reused.append(self.topk_memo is not None and self.topk_memo.replaces(layer_id))
        return select(self, layer_id, *args)

    monkeypatch.setattr(DSABackend, "select_topk", spy)
    requests = make_requests([5, 40], 10, 120, prompt_seed=9, temperature=0.0, ignore_eos=True)
    plain = run_all(local_engine(shared_index_model, options(0)), requests)
    assert run_all(local_engine(shared_index_model, options(3)), requests) == plain
    assert any(reused)  # draft steps 2..k took the recorded top-k instead of selecting


def test_generated_counts_emitted_tokens_only_across_chunked_prefills(default_model):
    requests = make_requests([70, 5, 40], [3, 4, 2], 6000, prompt_seed=5, temperature=0.0, ignore_eos=True)
    engine = local_engine(default_model, options(0))  # 32-token prefill chunks: the 70- and 40-token prompts split
    results = run_all(engine, requests)
    assert engine.stats.generated == sum(len(r["token_ids"]) for r in results) == 9


def test_prefill_phases_are_timed_only_when_asked(default_model):
    from model_workers.phase_clock import PHASES

    requests = make_requests([40], 2, 6000, prompt_seed=3, temperature=0.0, ignore_eos=True)  # two prefill chunks
    splits = {}
    for timed in (False, True):
        engine = local_engine(default_model, options(time_prefill_phases=timed))
        seen = []
        engine.add_step_observer(lambda step, results: step.prefill and seen.extend(r.prefill_phase_s for r in results))
        tokens = run_all(engine, requests)[0]["token_ids"]
        splits[timed] = (seen, tokens)
    (untimed, plain_tokens), (timed, timed_tokens) = splits[False], splits[True]
    assert len(untimed) == len(timed) == 2 and timed_tokens == plain_tokens
    assert untimed == [{}, {}]  # serving: no hooks on the model
    assert all(set(split) == set(PHASES) and split["attention"] > 0 and split["mlp"] > 0 for split in timed)


def test_prefill_runs_the_mtp_layer_only_for_speculation_or_shipped_logits(default_model):
    requests = make_requests([9, 4], 3, 6000, prompt_seed=5, temperature=0.0, ignore_eos=True)
    drafts, tokens = {}, {}
    for k, logits in ((0, False), (1, False), (0, True)):
        engine = local_engine(default_model, options(k=k, return_logits=logits))
        seen = []
        engine.add_step_observer(lambda step, results: step.prefill and seen.extend(
            out.draft_token_id for r in results for out in r.outputs.values()))
        tokens[k, logits] = [r["token_ids"] for r in run_all(engine, requests)]
        drafts[k, logits] = seen
    assert drafts[0, False] == [None, None]  # no speculation: nothing reads the MTP layer's output or KV rows
    assert all(d is not None for d in drafts[1, False] + drafts[0, True])
    assert tokens[0, False] == tokens[1, False] == tokens[0, True]


def test_idle_frees_ride_with_the_next_request_and_go_alone_only_after_a_delay(default_model):
    from cp_router.engine import IDLE_FREE_DELAY_S

    first, second = make_requests([6, 5], 3, 6000, prompt_seed=4, temperature=0.0, ignore_eos=True)
    alone = run_all(local_engine(default_model, options()), [second])[0]
    engine = local_engine(default_model, options())
    frees = []  # (frees, whether the step ran anything else) per step
    engine.add_step_observer(lambda step, _: frees.append(
        (sorted(f for plan in step.plans.values() for f in plan.free), bool(step.prefill or step.decode_ids))))

    async def scenario():
        await collect(engine, first)
        await asyncio.sleep(0.2)
        assert frees[-1][0] == [] and engine.scheduler.has_work()  # no step of frees alone right away
        result = await collect(engine, second)
        assert ([first.request_id], True) in frees  # the first request's free rode with the second's prefill
        await asyncio.sleep(IDLE_FREE_DELAY_S + 0.3)  # no request came: the free goes alone
        assert frees[-1] == ([second.request_id], False) and not engine.scheduler.has_work()
        return result

    assert asyncio.run(scenario())["token_ids"] == alone["token_ids"]
