"""Expert parallelism across the CP group on a real local Ray with gloo (CPU): invariant 8 (logits equal C = 1,
EP = 1 within fp32 tolerance for every C, EP, strategy and implementation), greedy and speculative decoding
in DP-attention lockstep, ranks that own no request, many requests with chunking, preemption and aborts, and
a rank that raises."""

import asyncio
from dataclasses import replace

import pytest
import ray
import torch

from cluster.engine_setup import run_all
from cp_router.protocol import EngineRequest
from support.cp_cluster import assert_kv_equal, cp_prefill, make_prompts, ray_groups, single_process
from support.tiny_models import add_mtp_layer, reference_model, save_reference

STRATEGIES = ["zigzag", "interleave"]
IMPLS = ["legacy", "v2"]
NUM_EXPERTS = 12  # splits over 2 and 3 ranks


@pytest.fixture(scope="module")
def cluster():
    with ray_groups([2, 3]) as groups:
        yield groups


@pytest.fixture(scope="module")
def moe12(tmp_path_factory):
    """The tiny V3.2 shape with 12 routed experts (3 per token) and an MTP layer (a MoE layer too)."""
    model = reference_model("v32", n_routed_experts=NUM_EXPERTS, num_experts_per_tok=3)
    folder = save_reference(model, tmp_path_factory.mktemp("moe12"))
    add_mtp_layer(folder)
    return model, folder


def reference_greedy(ref, ids: list[int], count: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_drained(engine) -> None:
    assert not engine.scheduler.requests
    assert engine.free_pages == [engine.scheduler.config.num_pages] * len(engine.workers)
    asyncio.run(engine.drain())
    assert ray.get([w.held_requests.remote() for w in engine.workers]) == [[]] * len(engine.workers)


@pytest.mark.parametrize("cp_size,ep_size", [(2, 1), (2, 2), (3, 1), (3, 3)])
def test_prefill_logits_equal_single_process_for_every_layout(cluster, moe12, cp_size, ep_size):
    _, folder = moe12
    for lens in ([23], [cp_size - 1, 17, 10], [2]):  # CP batches, and one too short to split (one rank + joiners)
        prompts = make_prompts(lens, seed=sum(lens))
        expected = single_process(folder, prompts)
        for strategy in STRATEGIES:
            for impl in IMPLS:
                run, _ = cp_prefill(cluster.engine(cp_size, folder, strategy, impl, ep_size=ep_size), prompts)
                for s, request_id in enumerate(run.request_ids):
                    out = run.outputs[request_id]
                    torch.testing.assert_close(out.logits, expected.logits[s], atol=1e-5, rtol=0)
                    torch.testing.assert_close(out.draft_logits, expected.draft_logits[s], atol=1e-5, rtol=0)
                    assert out.token_id == expected.tokens[s]
                    assert_kv_equal(run.kv[request_id], expected.kv[s], atol=1e-5)
                if ep_size > 1:  # every rank took part, even beside a one-rank prefill
                    assert len(run.ranks) == 1 or all(r.comm_bytes > 0 for r in run.ranks)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_each_rank_loads_only_its_experts(cluster, moe12, cp_size):
    _, folder = moe12
    workers = cluster.group(cp_size, folder, ep_size=cp_size).workers
    infos = ray.get([w.weights_info.remote() for w in workers])
    full = ray.get(cluster.group(cp_size, folder, ep_size=1).workers[0].weights_info.remote())
    per_rank = NUM_EXPERTS // cp_size
    assert [info["experts"] for info in infos] == [[r * per_rank, (r + 1) * per_rank] for r in range(cp_size)]
    assert full["experts"] == [0, NUM_EXPERTS]
    for info in infos:
        by_class, full_by_class = info["weight_bytes_by_class"], full["weight_bytes_by_class"]
        assert by_class["routed_experts"] * cp_size == full_by_class["routed_experts"]
        for cls in ("attention", "dense_mlp", "router", "shared_experts", "embeddings"):
            assert by_class[cls] == full_by_class[cls]  # replicated
        assert by_class["mtp"] < full_by_class["mtp"]  # the MTP layer's experts are split too
        assert info["parameter_bytes"] == info["weight_bytes_read"]  # float32 checkpoint: read = held


@pytest.mark.parametrize("cp_size,strategy,impl", [(2, "zigzag", "legacy"), (3, "interleave", "v2")])
def test_greedy_decode_under_ep_matches_transformers(cluster, moe12, cp_size, strategy, impl):
    ref, folder = moe12
    prompts = make_prompts([30, 9, 17], seed=5)
    engine = cluster.engine(cp_size, folder, strategy, impl, ep_size=cp_size)
    _, results = cp_prefill(engine, prompts, max_tokens=12)
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == reference_greedy(ref, prompt, 12)
    assert_drained(engine)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_speculation_and_owner_prefill_are_lossless_under_ep(cluster, moe12, cp_size):
    ref, folder = moe12
    prompts = make_prompts([21, 5, 14, 33], seed=11)
    _, plain = cp_prefill(cluster.engine(cp_size, folder, "zigzag", "legacy", ep_size=cp_size), prompts,
                          max_tokens=10)
    assert plain[0]["token_ids"] == reference_greedy(ref, prompts[0], 10)
    # cp_min 10_000: no CP, each owner prefills its prompts, the rest join; k = 0 without logits: no rank runs the
    # MTP layer (nothing reads it), the joining ranks skip its expert exchanges too
    for k, cp_min, logits in [(1, 0, True), (2, 0, True), (1, 10_000, True), (0, 10_000, False)]:
        engine = cluster.engine(cp_size, folder, "zigzag", "legacy", ep_size=cp_size, num_speculative_steps=k,
                                cp_min_prefill_tokens=cp_min, return_logits=logits)
        run, results = cp_prefill(engine, prompts, max_tokens=10)
        assert [r["token_ids"] for r in results] == [r["token_ids"] for r in plain], f"k={k}, cp_min={cp_min}"
        assert engine.stats.drafted > 0 if k else all(out.draft_token_id is None for out in run.outputs.values())
        if cp_min:
            assert run.cp_size_used == 1 and len(set(run.owners.values())) == min(cp_size, len(prompts))
        assert_drained(engine)


def test_ranks_without_requests_join_every_decode_step(cluster, moe12):
    ref, folder = moe12
    prompt = make_prompts([3], seed=4)[0]  # too short to split: one owner, the other ranks own nothing
    engine = cluster.engine(3, folder, "zigzag", "v2", ep_size=3, num_speculative_steps=2)
    decode_steps = []

    def observer(step, results):
        if step.decode_ids:
            decode_steps.append({r.cp_rank: r.num_collectives for r in results})

    engine.add_step_observer(observer)
    (result,) = run_all(engine, [EngineRequest("solo", tuple(prompt), 9, temperature=0.0, ignore_eos=True)])
    assert result["token_ids"] == reference_greedy(ref, prompt, 9)
    assert decode_steps and all(sorted(counts) == [0, 1, 2] for counts in decode_steps)
    for counts in decode_steps:  # identical collective sequences on the owner and the two idle ranks
        assert len(set(counts.values())) == 1 and counts[0] > 0
    assert_drained(engine)


def test_many_requests_with_chunking_preemption_and_aborts_under_ep(cluster, moe12):
    ref, folder = moe12
    lens = [1 + (i * 37) % 90 for i in range(64)]
    prompts = make_prompts(lens, seed=12)
    requests = [EngineRequest(f"q{i}", tuple(p), 4 + i % 7, temperature=0.0, ignore_eos=True)
                for i, p in enumerate(prompts)]
    engine = cluster.engine(2, folder, "interleave", "v2", ep_size=2, num_speculative_steps=1, num_pages=14,
                            prefill_token_budget=32)  # 112 token slots per rank: preemption; chunks of 32

    async def main():
        tasks = [asyncio.create_task(_collect(engine, r)) for r in requests]
        await asyncio.sleep(0.5)
        for task in tasks[::9]:  # aborts: the client goes away mid-request
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    finished = [(i, r) for i, r in enumerate(results) if isinstance(r, list)]
    assert len(finished) >= 64 - 8
    for i, tokens in finished[:12]:
        assert tokens == reference_greedy(ref, prompts[i], requests[i].max_tokens)
    assert engine.stats.preemptions > 0
    assert_drained(engine)


async def _collect(engine, request) -> list[int]:
    tokens = []
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
    return tokens


def test_a_rank_that_raises_fails_the_step_on_every_rank(cluster, moe12):
    _, folder = moe12
    engine = cluster.engine(2, folder, "zigzag", "legacy", ep_size=2)
    schedule, broken = engine.scheduler.schedule, []

    def schedule_with_a_broken_page_table():
        step = schedule()
        for cp_rank, plan in step.plans.items():
            if plan.decode and not broken:  # the owner's first decode item loses its pages
                lost = replace(plan.decode[0], pages=())
                step.plans[cp_rank] = replace(plan, decode=(lost,) + plan.decode[1:])
                broken.append(cp_rank)
        return step

    engine.scheduler.schedule = schedule_with_a_broken_page_table
    request = EngineRequest("doomed", tuple(make_prompts([12], seed=1)[0]), 6, temperature=0.0, ignore_eos=True)
    with pytest.raises(RuntimeError) as failure:
        run_all(engine, [request])
    message = str(failure.value)
    assert f"step failed on cp_rank {broken[0]}" in message and "page table of 0 pages" in message
    assert "stopped with it" in message  # the peer left its collective instead of waiting for it
    engine.scheduler.schedule = schedule  # the group was re-formed: the next requests are served exactly
    prompts = make_prompts([12, 20], seed=2)
    _, results = cp_prefill(engine, prompts, max_tokens=4)
    assert [r["token_ids"] for r in results] == [reference_greedy(moe12[0], p, 4) for p in prompts]
    assert_drained(engine)


def test_a_bf16_draft_wider_than_its_experts_joins_the_exchange_from_an_idle_rank(cluster, moe12):
    """bf16 weights on a CPU: the draft computes in float32 around bf16 routed experts (models/common/draft_dtype.py). The
    rank that owns no request joins every MTP expert exchange with rows of the experts' dtype, which is what the
    owner sends too; speculation stays lossless."""
    _, folder = moe12
    prompt = make_prompts([3], seed=4)[0]  # one owner; the other rank joins with no rows
    outputs = {}
    for k in (0, 2):
        engine = cluster.engine(2, folder, "zigzag", "v2", dtype="bfloat16", ep_size=2, num_speculative_steps=k)
        (result,) = run_all(engine, [EngineRequest(f"solo{k}", tuple(prompt), 9, temperature=0.0, ignore_eos=True)])
        outputs[k] = result["token_ids"]
        assert_drained(engine)
    assert outputs[2] == outputs[0]
