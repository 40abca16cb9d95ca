"""DeepSeek-V4 attention on a sliding-window layer equals `transformers`' `DeepseekV4Attention` (eager, no
cache) on the same random weights: q path, shared K = V, sinks, de-rotation and the grouped output, with the
queries attended block by block over a contiguous run of window rows."""

import copy

import pytest
import torch

from model_workers.kernels.registry import kernel_set
from model_workers.models.deepseek_v4.backend import V4Backend, local_batch
from model_workers.page_table import PageTable
from model_workers.models.common.rope import RotaryTable
from model_workers.models.deepseek_v4.attention import V4Attention
from model_workers.models.deepseek_v4.config import parse_v4_config
from model_workers.models.deepseek_v4.cache import V4Cache
from support.v4_models import randomized

RAW = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8, q_lora_rank=24,
           o_groups=2, o_lora_rank=8, sliding_window=6, index_n_heads=8, index_head_dim=8, index_topk=4,
           hc_mult=2, hc_sinkhorn_iters=3, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           compress_ratios=[0, 0], num_hash_layers=0, max_position_embeddings=256)


@pytest.mark.parametrize("block", [256, 4])
def test_sliding_layer_attention_equals_transformers(monkeypatch, block):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    monkeypatch.setattr("model_workers.models.deepseek_v4.attention.QUERY_BLOCK", block)
    ours, theirs = parse_v4_config(RAW), DeepseekV4Config(**copy.deepcopy(RAW))
    theirs._attn_implementation = "eager"
    reference = randomized(DeepseekV4Attention(theirs, 0), 11)
    attention = V4Attention(ours)
    attention.load_state_dict(reference.state_dict())
    length, window = 15, ours.sliding_window  # crosses the window twice
    x = torch.randn(1, length, 32, generator=torch.Generator().manual_seed(12))
    positions = torch.arange(length)
    rotary = DeepseekV4RotaryEmbedding(theirs)
    embeddings = {kind: rotary(x, positions[None], layer_type=kind) for kind in ("main", "compress")}
    q_idx, kv_idx = positions[:, None], positions[None, :]
    visible = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    mask = torch.where(visible, 0.0, float("-inf"))[None, None]  # [1, 1, T, T]
    cache = V4Cache(ours, num_pages=1, page_size=16)
    backend = V4Backend(cache, kernel_set()).bind(local_batch(cache, [PageTable([0])], [length], 16, "cpu"))
    with torch.no_grad():
        expected, _ = reference(x, embeddings, positions[None], mask)
        got = attention(x[0], positions, RotaryTable.of(ours.main_rope, ours.qk_rope_head_dim), backend, 0)
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)
