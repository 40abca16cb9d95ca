"""CP prefill across Ray actors on a real local Ray with gloo (CPU), driven by the engine that serves: one Ray
session for the module, one CP group per cp_size reused across strategies, implementations and checkpoints."""

import asyncio
import json
import shutil

import pytest
import ray
import torch

from cluster.config import ResolvedCPConfig
from cluster.launch import PlacementTimeout, launch_group
from support.cp_cluster import assert_kv_equal, cp_prefill, make_prompts, ray_groups, single_process
from support.tiny_models import add_mtp_layer, reference_model, save_reference

STRATEGIES = ["zigzag", "interleave"]
IMPLS = ["legacy", "v2"]
CP_SIZES = [1, 2, 3, 4]  # one group each, alive for the whole module
TOPK = 8  # index_topk of the tiny v32 checkpoint


@pytest.fixture(scope="module")
def cluster():
    with ray_groups(CP_SIZES) as groups:
        yield groups


@pytest.fixture(scope="module")
def v32(reference_checkpoint):
    return reference_checkpoint("v32", mtp=True)


def batches(cp_size: int) -> list[list[int]]:
    """1-3 requests; lengths < C, odd, not divisible by 2C, > index_topk, and one divisible by 2C."""
    return [[23], [max(1, cp_size - 1), 17, 10], [4 * cp_size, 9]]


def check_against_single_process(run, expected, atol: float, ref=None, prompts=None) -> None:
    """CP outputs equal the single-process path's; with `ref`, the logits also equal the transformers
    reference's (an oracle that shares no code with either path)."""
    for s, request_id in enumerate(run.request_ids):
        out = run.outputs[request_id]
        if ref is not None:
            with torch.no_grad():
                want = ref(torch.tensor([prompts[s]])).logits[0, -1]
            torch.testing.assert_close(out.logits, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(out.logits, expected.logits[s], atol=atol, rtol=0)
        torch.testing.assert_close(out.draft_logits, expected.draft_logits[s], atol=atol, rtol=0)
        assert out.token_id == expected.tokens[s]
        assert out.draft_token_id == int(expected.draft_logits[s].argmax())
        assert_kv_equal(run.kv[request_id], expected.kv[s], atol)


def assert_drained(engine) -> None:
    """No request, every page back with the scheduler, no state left on any rank."""
    assert not engine.scheduler.requests and engine.free_pages == [engine.scheduler.config.num_pages] * len(engine.workers)
    asyncio.run(engine.drain())  # the ranks' frees wait for a next request's step; drain sends them now
    assert ray.get([w.held_requests.remote() for w in engine.workers]) == [[]] * len(engine.workers)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_cp_prefill_equals_single_process(cluster, v32, cp_size, strategy, impl):
    ref, folder = v32
    engine = cluster.engine(cp_size, folder, strategy, impl)
    for lens in batches(cp_size):
        assert max(lens) > TOPK
        prompts = make_prompts(lens, seed=sum(lens))
        run, _ = cp_prefill(engine, prompts)
        assert run.prefill_steps == 1 and run.cp_size_used == cp_size and len(run.ranks) == cp_size
        assert sum(run.per_rank_logical_token) == sum(lens)
        check_against_single_process(run, single_process(folder, prompts), atol=1e-5, ref=ref, prompts=prompts)
        for cp_rank, held_ids in enumerate(run.held):  # after prefill only the owner keeps a request's state
            assert held_ids == sorted(rid for rid in run.request_ids if run.owners[rid] == cp_rank)
        if cp_size > 1:  # the plan agreement; per layer one gather of latent ‖ index key; hidden, MTP, MTP hidden
            assert all(r.num_collectives == 1 + 3 + 3 for r in run.ranks)
        assert_drained(engine)


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    """GLM-5 shape with a shared layer; its last layer is "full" so the MTP copy of it has an indexer."""
    model = reference_model("glm_shared", num_hidden_layers=3, indexer_types=["full", "shared", "full"])
    folder = save_reference(model, tmp_path_factory.mktemp("glm_mtp"))
    add_mtp_layer(folder)
    return model, folder


@pytest.mark.parametrize(
    "cp_size,strategy,impl", [(2, "zigzag", "legacy"), (2, "interleave", "v2"), (3, "zigzag", "v2"), (4, "interleave", "legacy")]
)
def test_glm_shared_layers_under_cp(cluster, glm_mtp, cp_size, strategy, impl):
    ref, folder = glm_mtp  # "shared" layers reuse the previous layer's top-k: their gathers carry no index key
    prompts = make_prompts([19, max(1, cp_size - 1), 10], seed=7)
    run, _ = cp_prefill(cluster.engine(cp_size, folder, strategy, impl), prompts)
    assert run.cp_size_used == cp_size
    check_against_single_process(run, single_process(folder, prompts), atol=1e-5, ref=ref, prompts=prompts)


@pytest.mark.parametrize("cp_size,strategy,lens", [(2, "zigzag", [3]), (3, "interleave", [2]), (4, "zigzag", [3, 4])])
def test_too_short_batches_take_the_non_cp_path(cluster, v32, cp_size, strategy, lens):
    _, folder = v32
    prompts = make_prompts(lens, seed=1)
    run, _ = cp_prefill(cluster.engine(cp_size, folder, strategy, "v2"), prompts)
    owners = [run.owners[rid] for rid in run.request_ids]
    assert run.cp_size_used == 1 and len(set(owners)) == len(lens)  # each prompt whole on its own (least loaded) rank
    assert run.per_rank_logical_token == tuple(lens[owners.index(r)] for r in sorted(owners))
    assert [r.cp_rank for r in run.ranks] == sorted(owners)  # the owners side by side, no collectives
    assert all(ran.num_collectives == 0 and ran.comm_bytes == 0 for ran in run.ranks)
    assert [len(h) for h in run.held] == [owners.count(r) for r in range(cp_size)]
    check_against_single_process(run, single_process(folder, prompts), atol=1e-5)


def reference_greedy(ref, ids: list[int], count: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("cp_size,strategy,impl", [(2, "zigzag", "legacy"), (3, "interleave", "v2"), (4, "zigzag", "v2")])
def test_greedy_generate_matches_transformers(cluster, v32, cp_size, strategy, impl):
    ref, folder = v32
    engine = cluster.engine(cp_size, folder, strategy, impl)
    prompts = make_prompts([30, 9, 17], seed=5)
    _, results = cp_prefill(engine, prompts, max_tokens=12)
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == reference_greedy(ref, prompt, 12)
    assert_drained(engine)


def test_twenty_prefill_batches_leak_no_pages(cluster, v32):
    _, folder = v32
    for i in range(20):  # CP batches, too-short batches, and batches that also decode a few tokens
        lens = [[2], [11, 5], [1, 30, 7], [40]][i % 4]
        engine = cluster.engine(3, folder, STRATEGIES[i % 2], IMPLS[(i // 2) % 2])
        cp_prefill(engine, make_prompts(lens, seed=i), max_tokens=3 if i % 5 == 0 else 1)
        assert_drained(engine)
    # 520 tokens > 64 pages x 8 on every rank: the scheduler admits the second request once the first is done
    run, results = cp_prefill(engine, make_prompts([500, 20]))
    assert run.prefill_steps == 2 and [len(r["token_ids"]) for r in results] == [1, 1]
    assert_drained(engine)


@pytest.fixture(scope="module")
def shared_index_folder(v32, tmp_path_factory):
    """The v32 + MTP checkpoint with MTP index sharing configured (GLM-5.2 style)."""
    folder = tmp_path_factory.mktemp("v32_mtp_index_share")
    for path in v32[1].iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "index_share_for_mtp_iteration": True}))
    return folder


def test_mtp_topk_rows_are_gathered_in_global_order(cluster, shared_index_folder):
    prompts = make_prompts([21, 2, 13], seed=9)
    runs = {}
    for cp_size, strategy in [(1, "zigzag"), (2, "interleave"), (3, "zigzag")]:
        runs[cp_size], _ = cp_prefill(cluster.engine(cp_size, shared_index_folder, strategy, "v2"), prompts)
    for s, prompt in enumerate(prompts):
        rows = [run.outputs[run.request_ids[s]].mtp_topk_positions for run in runs.values()]
        positions = torch.arange(len(prompt))[:, None]  # [L, 1]
        assert rows[0].shape == (len(prompt), min(TOPK, max(map(len, prompts))))  # batch-wide width
        assert bool(((rows[0] <= positions) & (rows[0] >= -1)).all())  # causal, -1 padded
        assert bool((rows[0] >= 0).sum(-1).eq(torch.clamp(positions[:, 0] + 1, max=TOPK)).all())
        for other in rows[1:]:
            assert torch.equal(other, rows[0])


@pytest.mark.parametrize("cp_size", [2, 4])
def test_bfloat16_cp_prefill_close_to_single_process(cluster, v32, cp_size):
    # A CP rank computes exactly the single-process ops on a subset of rows; only the fp32 accumulation order
    # inside matmuls of other row counts may differ (~1e-7 relative, see the 1e-5 float32 tests). In bf16
    # (8 mantissa bits) such a difference can at most flip the rounding of an intermediate by one ulp
    # (2^-8 relative); over 3 layers + MTP on logits of magnitude ~1.5 that stays well under 0.05. Tokens
    # must agree wherever the top-2 logit margin exceeds that bound.
    _, folder = v32
    prompts = make_prompts([37, 3, 21], seed=2)
    expected = single_process(folder, prompts, torch.bfloat16)
    for strategy in STRATEGIES:
        run, _ = cp_prefill(cluster.engine(cp_size, folder, strategy, "v2", dtype="bfloat16"), prompts)
        for s, request_id in enumerate(run.request_ids):
            out = run.outputs[request_id]
            for got, want in [(out.logits, expected.logits[s]), (out.draft_logits, expected.draft_logits[s])]:
                assert (got - want).abs().max() < 0.05
                top2 = want.topk(2).values
                if top2[0] - top2[1] > 0.1:
                    assert int(got.argmax()) == int(want.argmax())
            assert_kv_equal(run.kv[request_id], expected.kv[s], atol=0.05)


def test_unplaceable_group_fails_with_the_resources_it_asked_for(cluster, v32):
    cp = ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="legacy")
    with pytest.raises(PlacementTimeout, match=r"2 bundles \{'GPU': 1\}"):
        launch_group(v32[1], cp, use_gpu=True, placement_timeout_s=2)
    states = [g["state"] for g in ray.util.placement_group_table().values()]
    assert states.count("CREATED") == len(cluster.groups)  # the failed group was removed


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    target, _, folder = v4_checkpoint_with_mtp(tmp_path_factory.mktemp("v4_cp"))
    return target, folder


def v4_batches(cp_size: int) -> list[list[int]]:
    """Lengths < C, not divisible by C, crossing the window (8) and both compression rates (4, 8)."""
    return [[37], [max(1, cp_size - 1), 23, 10]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_v4_cp_prefill_equals_single_process(cluster, v4, cp_size, strategy, impl):
    """DeepSeek-V4: every rank pools the gathered compressor rows, so entries, window rows, last-token and MTP
    logits equal one rank's (and transformers'), for both layouts; hash-routed rows keep their token ids."""
    ref, folder = v4
    engine = cluster.engine(cp_size, folder, strategy, impl)
    for lens in v4_batches(cp_size):
        prompts = make_prompts(lens, seed=sum(lens) + 1)
        run, _ = cp_prefill(engine, prompts)
        assert run.prefill_steps == 1 and run.cp_size_used == cp_size
        check_against_single_process(run, single_process(folder, prompts), atol=1e-5, ref=ref, prompts=prompts)
        assert_drained(engine)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_v4_cp_prefill_with_expert_parallelism_equals_single_process(cluster, v4, cp_size):
    ref, folder = v4
    engine = cluster.engine(cp_size, folder, "interleave", "v2", ep_size=cp_size)
    prompts = make_prompts([31, max(1, cp_size - 1), 14], seed=5)
    run, _ = cp_prefill(engine, prompts)
    check_against_single_process(run, single_process(folder, prompts), atol=1e-5, ref=ref, prompts=prompts)
    assert_drained(engine)


def test_v4_cp_prefill_in_bfloat16_equals_single_process(cluster, v4):
    """bf16 weights and cache: the gathered rows are the cache's (bf16) on every path, so C = 2 equals C = 1."""
    _, folder = v4
    engine = cluster.engine(2, folder, "interleave", "legacy", dtype="bfloat16")
    prompts = make_prompts([33, 1, 12], seed=7)
    run, _ = cp_prefill(engine, prompts)
    check_against_single_process(run, single_process(folder, prompts, torch.bfloat16), atol=1e-5)
    assert_drained(engine)
