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
    with pytest.raises(ValueError, match="not available for deepseek_v4 yet; allowed: bfloat16, float32"):
        plan(quantized, cp_size=1, ep_size=1, kv_cache_dtype="fp8_e4m3")
