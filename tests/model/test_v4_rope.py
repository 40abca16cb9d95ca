"""DeepSeek-V4 RoPE: the main (plain) and compress (YaRN, no mscale) tables and the layout-keeping interleaved
rotation equal `transformers`' rotary embedding and `apply_rotary_pos_emb`; de-rotation inverts it."""

import copy

import torch

from model_workers.models.common.rope import RotaryTable, rotate_pairs
from model_workers.models.deepseek_v4.config import parse_v4_config

RAW = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8, q_lora_rank=24,
           o_groups=2, o_lora_rank=8, sliding_window=8, index_n_heads=8, index_head_dim=8, index_topk=4,
           hc_mult=4, hc_sinkhorn_iters=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           compress_ratios=[0, 4, 128], num_hash_layers=1, max_position_embeddings=2048,
           rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1})


def test_tables_and_rotation_equal_transformers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding, apply_rotary_pos_emb

    ours, theirs = parse_v4_config(RAW), DeepseekV4Config(**copy.deepcopy(RAW))
    reference = DeepseekV4RotaryEmbedding(theirs)
    positions = torch.tensor([0, 1, 5, 127, 128, 1000, 2047])
    x = torch.randn(len(positions), 3, 16, generator=torch.Generator().manual_seed(0))  # [T, heads, head_dim]
    for kind, spec in (("main", ours.main_rope), ("compress", ours.compress_rope)):
        cos, sin = RotaryTable.of(spec, ours.qk_rope_head_dim).for_positions(positions)
        cos_ref, sin_ref = reference(x, positions[None], layer_type=kind)
        torch.testing.assert_close(cos, cos_ref[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, sin_ref[0], atol=1e-6, rtol=0)
        rope = x[..., -8:]
        expected = apply_rotary_pos_emb(x.transpose(0, 1)[None], cos_ref, sin_ref)[0].transpose(0, 1)
        torch.testing.assert_close(torch.cat([x[..., :-8], rotate_pairs(rope, cos, sin)], -1), expected,
                                   atol=1e-6, rtol=0)
        back = rotate_pairs(rotate_pairs(rope, cos, sin), cos, sin, inverse=True)
        torch.testing.assert_close(back, rope, atol=1e-5, rtol=0)
    assert not torch.equal(RotaryTable.of(ours.main_rope, 8).inv_freq, RotaryTable.of(ours.compress_rope, 8).inv_freq)
