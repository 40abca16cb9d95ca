"""DeepSeek-V4's HCA compressor equals `transformers`' (stateless prefill) and gives the same entries when the
rows arrive in chunks that split windows (the caller keeps the open window's rows)."""

import copy

import torch

from model_workers.models.common.rope import RotaryTable
from model_workers.models.deepseek_v4.compress import CSACompressor, HCACompressor, visible_entries
from model_workers.models.deepseek_v4.config import parse_v4_config
from support.v4_models import randomized

RAW = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8, q_lora_rank=24,
           o_groups=2, o_lora_rank=8, sliding_window=6, index_n_heads=8, index_head_dim=8, index_topk=4,
           hc_mult=2, hc_sinkhorn_iters=3, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           compress_ratios=[128, 128], compress_rate_hca=5, num_hash_layers=0, max_position_embeddings=256,
           rope_scaling={"type": "yarn", "factor": 8, "original_max_position_embeddings": 32, "beta_fast": 32,
                         "beta_slow": 1})


def test_hca_entries_equal_transformers_and_do_not_depend_on_chunking():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACompressor

    ours, theirs = parse_v4_config(RAW), DeepseekV4Config(**copy.deepcopy(RAW))
    reference = randomized(DeepseekV4HCACompressor(theirs), 21)
    compressor = HCACompressor(ours)
    compressor.load_state_dict({k: v for k, v in reference.state_dict().items() if not k.startswith("rotary")})
    table = RotaryTable.of(ours.compress_rope, ours.qk_rope_head_dim)
    length, rate = 23, 5  # 4 closed windows and 3 open rows
    x = torch.randn(1, length, 32, generator=torch.Generator().manual_seed(22))
    positions = torch.arange(length)
    with torch.no_grad():
        expected, bias = reference(x, None, positions[None], None, 0)  # [1, 1, 4, Dh], [1, 1, T, 4]
        kv, gate = compressor.project(x[0])
        whole = compressor.entries(kv[:20], gate[:20], 0, table)
        torch.testing.assert_close(whole, expected[0, 0], atol=1e-5, rtol=0)
        assert torch.equal(visible_entries(positions, 4, rate), bias[0, 0] == 0)
        pieces, open_kv, open_gate, windows = [], kv[:0], gate[:0], 0  # chunks of 7 rows: windows split
        for start in range(0, length, 7):
            open_kv = torch.cat([open_kv, kv[start:start + 7]])
            open_gate = torch.cat([open_gate, gate[start:start + 7]])
            closed = open_kv.shape[0] // rate * rate
            pieces.append(compressor.entries(open_kv[:closed], open_gate[:closed], windows, table))
            windows, open_kv, open_gate = windows + closed // rate, open_kv[closed:], open_gate[closed:]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-6, rtol=0)
    assert open_kv.shape[0] == 3


def test_csa_entries_equal_transformers_and_carry_the_overlap_across_chunks():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor

    raw = {**RAW, "compress_ratios": [4, 4]}
    ours, theirs = parse_v4_config(raw), DeepseekV4Config(**copy.deepcopy(raw))
    reference = randomized(DeepseekV4CSACompressor(theirs), 31)
    compressor = CSACompressor(ours)
    own = ("kv_proj.", "gate_proj.", "position_bias", "kv_norm.")
    compressor.load_state_dict({k: v for k, v in reference.state_dict().items() if k.startswith(own)})
    table = RotaryTable.of(ours.compress_rope, ours.qk_rope_head_dim)
    length, rate = 18, 4  # 4 closed windows, 2 open rows
    x = torch.randn(1, length, 32, generator=torch.Generator().manual_seed(32))
    q_residual = torch.randn(1, length, 24, generator=torch.Generator().manual_seed(33))
    with torch.no_grad():
        expected, _ = reference(x, q_residual, torch.arange(length)[None], None, 0)  # [1, 1, 4, Dh]
        kv, gate = compressor.project(x[0])
        whole = compressor.entries(kv[:16], gate[:16], 0, table)
        torch.testing.assert_close(whole, expected[0, 0], atol=1e-5, rtol=0)
        pieces, start = [], 0
        for end in (5, 6, 13, 18):  # chunk ends misaligned with the windows
            closed_end = end // rate * rate
            if closed_end > start:  # the rows again from one window back (its Ca half), that entry dropped
                first = max(0, start // rate - compressor.lookback_windows)
                entries = compressor.entries(kv[first * rate:closed_end], gate[first * rate:closed_end], first, table)
                pieces.append(entries[start // rate - first:])
                start = closed_end
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-6, rtol=0)
