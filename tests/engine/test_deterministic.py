"""--enable-deterministic-inference: a request's tokens and logprobs (and its top alternatives) are bit-identical
(exact float equality) alone, inside a batch of 16 other requests, prefilled in chunks of 64 / 256 / whole, at
C = 1 and C = 2 (zigzag and interleave), EP = 1 and 2, owned by either rank, greedy with k = 0 and k = 2;
seeded sampling repeats under other concurrent load; re-prefilling prompt + output rebuilds its KV bit for bit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import engine_cpus, launch_group, start_ray
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.loader import load_model
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.kernels.torch.batch_invariant import BatchInvariantMode
from model_workers.kernels.torch.topk import earliest_topk
from model_workers.runner import ExtendItem, ModelRunner
from support.cp_cluster import cache_rows
from support.engines import local_engine

MODEL = resolve_model_dir(None)
DTYPE = "bfloat16"  # the default model's stored dtype: what `serve --dtype auto` runs
NUM_PAGES, PAGE_SIZE, MAX_TOKENS = 96, 64, 10
VOCAB = 6144


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


TARGET = EngineRequest("target", prompt(700, 0), MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
# 16 others of every kind: lengths 3..400, greedy and sampled, some with penalties
OTHERS = [EngineRequest(f"other{i}", prompt(3 + (i * 97) % 400, 100 + i), 4 + i % 9,
                        temperature=0.0 if i % 3 == 0 else 0.9, seed=i, ignore_eos=True,
                        repetition_penalty=1.2 if i % 4 == 1 else 1.0) for i in range(16)]


def options(**overrides) -> EngineOptions:
    settings = dict(dtype=DTYPE, num_pages=NUM_PAGES, page_size=PAGE_SIZE, deterministic=True)
    return EngineOptions(**{**settings, **overrides})


def outcomes(engine, requests: list[EngineRequest]) -> dict[str, tuple]:
    """Every request's (tokens, [(logprob, top alternatives)]) from a run of all `requests` at once."""
    async def collect(request):
        chunks = [chunk async for chunk in engine.generate(request)]
        tokens = [t for c in chunks for t in c.token_ids]
        return tokens, [(lp.logprob, lp.top) for c in chunks for lp in (c.logprobs or ())]

    async def main():
        return dict(zip([r.request_id for r in requests], await asyncio.gather(*[collect(r) for r in requests])))

    return asyncio.run(main())


def outcome(engine, requests: list[EngineRequest]) -> tuple:
    """The target's outcome from a run of all `requests` at once."""
    return outcomes(engine, requests)["target"]


def test_earliest_topk_breaks_ties_towards_earlier_keys_whatever_follows():
    scores = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0]])
    assert earliest_topk(scores, 3).tolist() == [[0, 1, 3]]  # 2 and 1, then the first of the tied zeros
    longer = torch.cat([scores, torch.full((1, 5), float("-inf"))], dim=1)
    assert earliest_topk(longer, 3).tolist() == [[0, 1, 3]]


@pytest.fixture(scope="module")
def alone():
    """The target alone, C = 1, prefilled whole: what every other configuration must reproduce."""
    return outcome(local_engine(MODEL, options(prefill_token_budget=2048)), [TARGET])


@pytest.mark.parametrize("budget, batch", [(2048, True), (64, False), (256, True)])
def test_c1_batch_and_chunking_change_no_bit(alone, budget, batch):
    engine = local_engine(MODEL, options(prefill_token_budget=budget))
    requests = [*OTHERS[:8], TARGET, *OTHERS[8:]] if batch else [TARGET]
    assert outcome(engine, requests) == alone


def test_c1_in_float32_too():
    """float32 products are the ones whose bits depend on the row count (kernels/torch/batch_invariant.py)."""
    alone32 = outcome(local_engine(MODEL, options(dtype="float32", prefill_token_budget=2048)), [TARGET])
    engine = local_engine(MODEL, options(dtype="float32", prefill_token_budget=256))
    assert outcome(engine, [*OTHERS[:8], TARGET, *OTHERS[8:]]) == alone32


def test_c1_speculation_k2_is_plain_decoding_bit_for_bit(alone):
    engine = local_engine(MODEL, options(prefill_token_budget=256, num_speculative_steps=2))
    assert outcome(engine, [*OTHERS, TARGET]) == alone


def test_seeded_sampling_repeats_under_other_load():
    sampled = [EngineRequest(f"s{i}", prompt(40 + 30 * i, 50 + i), 24, temperature=0.8, seed=7 + i, logprobs=1,
                             ignore_eos=True) for i in range(4)]
    first = outcomes(local_engine(MODEL, options(prefill_token_budget=2048)), sampled)
    again = outcomes(local_engine(MODEL, options(prefill_token_budget=64)), [*OTHERS[:6], *reversed(sampled)])
    assert {r.request_id: again[r.request_id] for r in sampled} == first


def test_reprefill_of_prompt_and_output_rebuilds_the_kv_bit_for_bit():
    """Decode writes a token's keys one step at a time; prefilling prompt + output in one go (and in chunks)
    writes the same bytes."""
    model = load_model(MODEL, progress=False, dtype=getattr(torch, DTYPE))
    ids = list(prompt(300, 3))
    with BatchInvariantMode():
        decoding = ModelRunner(model, num_pages=16, page_size=PAGE_SIZE, deterministic=True)
        (table,) = decoding.standalone_tables([len(ids) + 12])
        hidden = decoding.extend([ExtendItem(table, ids)])
        for _ in range(12):
            token = int(model.logits(hidden[-1:]).argmax())
            ids.append(token)
            hidden = decoding.extend([ExtendItem(table, [token])], is_extend=False)
        for chunk in (len(ids), 100):
            prefilling = ModelRunner(model, num_pages=16, page_size=PAGE_SIZE, deterministic=True)
            (again,) = prefilling.standalone_tables([len(ids)])
            for start in range(0, len(ids), chunk):
                prefilling.extend([ExtendItem(again, ids[start:start + chunk])])
            expected, got = cache_rows(decoding.cache, table), cache_rows(prefilling.cache, again)
            assert expected.keys() == got.keys()
            for name in expected:
                for a, b in zip(expected[name], got[name]):
                    assert (a is None and b is None) or torch.equal(a, b), (name, chunk)


@pytest.fixture(scope="module")
def groups():
    """Two C = 2 groups loaded deterministic: experts replicated (EP = 1) and partitioned (EP = 2)."""
    start_ray(min_cpus=2 * engine_cpus(2))
    launched = {ep: launch_group(MODEL, ResolvedCPConfig(True, 2, "zigzag", "legacy", ep_size=ep), DTYPE, NUM_PAGES,
                                 PAGE_SIZE, deterministic=True) for ep in (1, 2)}
    yield launched
    for group in launched.values():
        group.shutdown()
    import ray

    ray.shutdown()


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_cp_and_ep_give_the_bits_of_one_rank_whichever_rank_owns_it(alone, groups, strategy, ep_size):
    cp = ResolvedCPConfig(True, 2, strategy, "legacy", ep_size=ep_size)
    owners = set()
    for requests, budget in (([TARGET], 2048), ([OTHERS[0], TARGET, *OTHERS[1:]], 256)):
        engine = engine_over_workers(resolve_engine_spec(MODEL, cp, options(prefill_token_budget=budget)),
                                     groups[ep_size].workers)
        engine.add_step_observer(lambda step, results: owners.update(
            o for p, o in zip(step.prefill.pieces, step.prefill.owners) if p.request_id == "target")
            if step.prefill is not None else None)
        assert outcome(engine, requests) == alone
    assert owners == {0, 1}


def test_deepseek_v4_is_refused_before_any_worker_starts(tmp_path):
    """Measured: V4's outputs still depend on the batch under the mode (its pooled compressed attention), so the
    flag says so instead of promising bits it does not deliver."""
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    _, _, folder = v4_checkpoint_with_mtp(tmp_path)
    with pytest.raises(ValueError, match="built for deepseek_v32, glm_moe_dsa; deepseek_v4 is not batch-invariant"):
        local_engine(folder, EngineOptions(deterministic=True))


def test_glm5_shared_indexer_and_mtp_index_sharing_stay_bit_exact(reference_checkpoint):
    """GLM-5's layout: shared-indexer layers reuse a full layer's top-k (6 keys here, so selection is active
    from the 7th token on) and its MTP layer shares its top-k across draft steps."""
    _, folder = reference_checkpoint("glm_shared", mtp=True)

    def requests(vocab=128):
        def ids(n, s):
            return tuple(torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(s)).tolist())
        target = EngineRequest("target", ids(90, 0), 12, temperature=0.0, ignore_eos=True, logprobs=2)
        return target, [EngineRequest(f"o{i}", ids(5 + 23 * i, i + 1), 3 + i, temperature=0.0, ignore_eos=True)
                        for i in range(8)]

    target, others = requests()
    glm = dict(dtype="float32", num_pages=64, page_size=16, deterministic=True)
    alone = outcome(local_engine(folder, EngineOptions(**glm, prefill_token_budget=512)), [target])
    for budget, k in ((512, 0), (32, 0), (32, 2)):
        engine = local_engine(folder, EngineOptions(**glm, prefill_token_budget=budget, num_speculative_steps=k))
        assert outcome(engine, [*others[:4], target, *others[4:]]) == alone, (budget, k)


def test_constrained_outputs_are_the_same_bits_at_c1_and_c2_for_k_0_and_2(groups):
    """Structured outputs: greedy and seeded, a JSON schema and a regex; the mask is applied by whichever rank
    samples (every rank of a CP prefill, the owner in decode) and verification masks each row as plain decoding."""
    import json

    from cp_router.grammar_spec import GrammarSpec
    from model_workers.checkpoint.tokenizer import load_tokenizer

    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["x", "y"]}}}
    specs = [GrammarSpec("json_schema", json.dumps(schema)), GrammarSpec("regex", r"[a-z_]{1,12}\(\)")]
    head = tuple(load_tokenizer(MODEL).encode("import json\n\nCONFIG = json.loads('").ids)
    requests = [EngineRequest(f"g{i}-{t}", prompt(90 + 40 * i, 300 + i) + head, 120, temperature=t, seed=11 + i,
                              logprobs=2, grammar=spec) for i, spec in enumerate(specs) for t in (0.0, 0.9)]
    expected = outcomes(local_engine(MODEL, options(prefill_token_budget=2048)), requests)
    assert all(len(tokens) > 3 for tokens, _ in expected.values())
    for k in (0, 2):
        if k:
            assert outcomes(local_engine(MODEL, options(num_speculative_steps=k)), requests) == expected
        cp = ResolvedCPConfig(True, 2, "zigzag", "legacy")
        engine = engine_over_workers(resolve_engine_spec(MODEL, cp, options(num_speculative_steps=k,
                                                                  cp_min_prefill_tokens=0)),
                                     groups[1].workers)
        assert outcomes(engine, requests) == expected, f"C = 2, k = {k}"
