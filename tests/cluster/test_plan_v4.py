"""`dsa-serve plan` for DeepSeek-V4: per-tensor stored bytes follow the release formats (FP8 + ue8m0 blocks, FP4
experts, float32 / int64 tensors), so the plan's totals equal the checkpoint's bytes and each rank's equal what
its loader reads under EP; KV bytes per token follow the compressed-entry formula."""

import math

import pytest
from safetensors import safe_open

from model_workers.checkpoint.capacity import plan
from model_workers.checkpoint.loader import load_model_with_report
from support.v4_checkpoints import v4_checkpoint_with_mtp

ELEMENT_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "F32": 4, "I64": 8, "BF16": 2}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return v4_checkpoint_with_mtp(tmp_path_factory.mktemp("v4_plan"), quantized=True)[2]


def test_plan_bytes_equal_the_checkpoint_and_the_loader(quantized):
    with safe_open(quantized / "model.safetensors", "pt") as handle:
        stored = sum(math.prod(handle.get_slice(k).get_shape()) * ELEMENT_BYTES[handle.get_slice(k).get_dtype()]
                     for k in handle.keys())
    out = plan(quantized, cp_size=2, ep_size=2)
    assert out["total_checkpoint_bytes"] == stored
    for rank in range(2):
        _, report = load_model_with_report(quantized, progress=False, ep_rank=rank, ep_size=2)
        assert out["per_rank_weight_bytes"][rank] == report.total_bytes


def test_kv_bytes_per_token_follow_the_compressed_entries(quantized):
    out = plan(quantized, cp_size=1, ep_size=1, kv_cache_dtype="float32")
    # TINY_V4: two CSA layers (head_dim 32 + index_head_dim 16 per 4 tokens), one HCA layer (32 per 8 tokens)
    assert out["kv_bytes_per_token"] == 4 * (2 * (32 + 16) / 4 + 32 / 8)
    with pytest.raises(ValueError, match="not available for deepseek_v4 yet; allowed: auto, bfloat16, float32"):
        plan(quantized, cp_size=1, ep_size=1, kv_cache_dtype="fp8_e4m3")


def flash_config() -> dict:
    """DeepSeek-V4-Flash's released config.json values (docs/models.md, 'Configuration')."""
    return dict(
        model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], index_n_heads=64, index_head_dim=128,
        index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, num_hash_layers=3, n_routed_experts=256,
        num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048, num_nextn_predict_layers=1,
        max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                      "beta_slow": 1},
        torch_dtype="bfloat16", expert_dtype="fp4",
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})


def test_v4_flash_plan_counts_its_284b_parameters_and_its_kv(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(flash_config()))
    out = plan(tmp_path, cp_size=8, ep_size=8, device_memory_gib=141)
    assert out["params"]["target_model"] == pytest.approx(284e9, rel=0.005)  # the published 284 B
    assert out["kv"]["layer_types"] == {"compressed_sparse_attention": 21, "heavily_compressed_attention": 20,
                                        "sliding_attention": 2}
    assert out["kv_bytes_per_token"] == 2 * 3440  # docs/models.md, 'Cache': 21 × 640 / 4 + 20 × 512 / 128 values
    assert out["max_rank_weight_bytes"] < out["total_checkpoint_bytes"] / 5 and out["weights_fit"]
