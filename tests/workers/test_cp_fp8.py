"""The FP8 KV cache under CP prefill across Ray actors (gloo): C = 2, 3 equal C = 1 with FP8 (logits within 1e-5
in float32 compute, the owner's KV bytes identical), with and without expert parallelism; the gathers move the
FP8 bytes (measured = formula); and the RoPE positions the quantize step sees come from the data's layout."""

import pytest
import torch

import cp_router.cp.metadata as cp_metadata
from cp_router.cp.strategies import get_strategy
from support.cp_cluster import assert_kv_equal, cp_prefill, make_prompts, ray_groups, single_process
from support.tiny_models import BASE, add_mtp_layer, reference_model, save_reference

STRATEGIES = ["zigzag", "interleave"]
IMPLS = ["legacy", "v2"]
CP_SIZES = [2, 3]
FP8 = "fp8_e4m3"


@pytest.fixture(scope="module")
def cluster():
    with ray_groups(CP_SIZES) as groups:
        yield groups


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """The tiny V3.2 shape with MTP and 6 routed experts, so that ep_size = cp_size splits them for C = 2 and 3."""
    model = reference_model("v32", n_routed_experts=6)
    folder = save_reference(model, tmp_path_factory.mktemp("v32_fp8"))
    add_mtp_layer(folder)
    return model, folder


def fp8_bytes_per_token() -> int:
    """The tiny V3.2 shape: 3 target layers + 1 MTP layer, all with an indexer; docs/kv_cache.md's FP8 layout,
    counted here from the shapes alone: c_kv FP8 + one fp32 scale per 128, k_pe bf16; index key FP8 + scale."""
    c_kv, rope, index = BASE["kv_lora_rank"], BASE["qk_rope_head_dim"], BASE["index_head_dim"]
    latent = c_kv + 4 * -(-c_kv // 128) + 2 * rope  # 32 + 4 + 32 = 68
    return 4 * (latent + index + 4 * -(-index // 128))  # 4 x (68 + 36)


def check_equal_to_one_rank(run, expected) -> None:
    for s, request_id in enumerate(run.request_ids):
        out = run.outputs[request_id]
        torch.testing.assert_close(out.logits, expected.logits[s], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.draft_logits, expected.draft_logits[s], atol=1e-5, rtol=0)
        assert out.token_id == expected.tokens[s]
        assert_kv_equal(run.kv[request_id], expected.kv[s], atol=0)  # uint8 rows: compared bit for bit
        assert all(t is None or t.dtype == torch.uint8 for rows in run.kv[request_id].values() for t in rows)


@pytest.mark.parametrize("ep", ["ep1", "ep=cp"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp_size", [2, 3])
def test_fp8_cp_prefill_equals_single_process_fp8(cluster, v32, cp_size, strategy, impl, ep):
    _, folder = v32
    ep_size = cp_size if ep == "ep=cp" else 1
    engine = cluster.engine(cp_size, folder, strategy, impl, ep_size=ep_size, kv_cache_dtype=FP8)
    for lens in ([29], [max(1, cp_size - 1), 17, 10]):
        prompts = make_prompts(lens, seed=sum(lens) + cp_size)
        run, _ = cp_prefill(engine, prompts)
        assert run.prefill_steps == 1 and run.cp_size_used == cp_size
        check_equal_to_one_rank(run, single_process(folder, prompts, kv_cache_dtype=FP8))
        for rank in run.ranks:  # per cache layer every rank received (C-1) x collective_rows stored FP8 rows
            assert rank.kv_comm_bytes == (cp_size - 1) * run.collective_rows * fp8_bytes_per_token()


# The seed's bug, reproduced through a test-only hook: the one position routine (`rope_positions`) swapped for
# the other implementation's, as that implementation shards a batch by default for DSA models (docs/architecture.md, 'Which implementation runs':
# v2 with interleave, legacy with zigzag). The data keeps its own layout, so keys are roped (then quantized) at
# positions of another layout.
OTHER_ROUTINE = {"v2": ("legacy", "zigzag"), "legacy": ("v2", "interleave")}


def positions_of_the_other_routine(strategy, impl, extend_lens, prefix_lens, local_to_global, physical):
    other_impl, other_strategy = OTHER_ROUTINE[impl]
    other = get_strategy(other_strategy)
    other_rows = [other.local_to_global(extend_lens, len(physical), r) for r in range(len(physical))]
    assert [t.numel() for t in other_rows] == [t.numel() for t in local_to_global]  # a pure substitution
    return REAL_ROPE_POSITIONS(other, other_impl, extend_lens, prefix_lens, other_rows, physical)


REAL_ROPE_POSITIONS = cp_metadata.rope_positions


@pytest.mark.parametrize("impl,strategy", [("v2", "interleave"), ("legacy", "zigzag")])
def test_positions_sharded_by_the_other_routine_change_the_output(cluster, v32, monkeypatch, impl, strategy):
    _, folder = v32
    prompts = make_prompts([16, 8], seed=3)  # C = 2: 12 rows per rank in both layouts, different tokens
    expected = single_process(folder, prompts, kv_cache_dtype=FP8)
    meta = cp_metadata.build_cp_metadata([16, 8], [0, 0], 2, strategy, impl)
    wrong = positions_of_the_other_routine(get_strategy(strategy), impl, [16, 8], [0, 0], meta.local_to_global,
                                           meta.per_rank_physical_token)
    assert not all(torch.equal(a, b) for a, b in zip(wrong, meta.positions_local))  # the layouts differ here

    engine = cluster.engine(2, folder, strategy, impl, kv_cache_dtype=FP8)
    with monkeypatch.context() as patch:
        patch.setattr(cp_metadata, "rope_positions", positions_of_the_other_routine)
        buggy, _ = cp_prefill(engine, prompts)
    for s, request_id in enumerate(buggy.request_ids):
        assert (buggy.outputs[request_id].logits - expected.logits[s]).abs().max() > 1e-2
        assert not torch.equal(buggy.kv[request_id]["latent"][0], expected.kv[s]["latent"][0])

    real, _ = cp_prefill(engine, prompts)  # the routine of the data's own layout: C = 2 equals C = 1
    assert real.cp_size_used == 2
    check_equal_to_one_rank(real, expected)
