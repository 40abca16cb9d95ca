"""DeepSeek-V4's mHC streams and MoE layer equal `transformers`' modules on the same random weights."""

import copy

import pytest
import torch

from model_workers.models.deepseek_v4.blocks import HyperConnection, HyperHead, expand_streams, v4_moe
from model_workers.models.deepseek_v4.config import parse_v4_config
from support.v4_models import randomized

RAW = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=4, q_lora_rank=24,
           o_groups=2, o_lora_rank=8, sliding_window=8, index_n_heads=8, index_head_dim=8, index_topk=4,
           hc_mult=4, hc_sinkhorn_iters=7, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
           compress_ratios=[0, 4, 128, 0], num_hash_layers=1, swiglu_limit=0.5, routed_scaling_factor=1.5)


class LocalExperts:
    def routed_experts(self, layer_id, x, expert_ids, weights, experts):
        return experts(x, expert_ids, weights)


@pytest.fixture(scope="module")
def configs():
    from transformers import DeepseekV4Config

    return parse_v4_config(RAW), DeepseekV4Config(**copy.deepcopy(RAW))


def test_hyper_connection_and_head_equal_transformers(configs):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    ours, theirs = configs
    streams = torch.randn(1, 5, 4, 32, generator=torch.Generator().manual_seed(1))  # [B, T, N, D]
    block_out = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))
    reference = randomized(DeepseekV4HyperConnection(theirs), 3)
    hc = HyperConnection(ours)
    hc.load_state_dict(reference.state_dict())
    post_ref, comb_ref, collapsed_ref = reference(streams)
    post, comb, collapsed = hc(streams[0])
    torch.testing.assert_close(collapsed, collapsed_ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(comb, comb_ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-4, rtol=0)  # Sinkhorn ends on columns
    expected = post_ref.unsqueeze(-1) * block_out.unsqueeze(-2) + comb_ref.transpose(-1, -2) @ streams
    torch.testing.assert_close(expand_streams(post, comb, block_out[0], streams[0]), expected[0], atol=1e-6, rtol=0)
    head_ref = randomized(DeepseekV4HyperHead(theirs), 4)
    head = HyperHead(ours)
    head.load_state_dict(head_ref.state_dict())
    torch.testing.assert_close(head(streams[0]), head_ref(streams)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer_id", [0, 1])  # 0: hash-routed (tid2eid), 1: learned routing with the bias
def test_moe_layer_equals_transformers(configs, layer_id):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    ours, theirs = configs
    reference = randomized(DeepseekV4SparseMoeBlock(theirs, layer_id), 5 + layer_id)
    moe = v4_moe(ours, layer_id)
    moe.load_state_dict(reference.state_dict())
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(7))
    token_ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = reference(x, input_ids=token_ids)[0]
        got = moe(x[0], LocalExperts(), layer_id, token_ids[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    clamped = moe.shared_experts.gate_proj(x[0]).max() > ours.swiglu_limit
    assert clamped  # the clamp is exercised
    if layer_id == 0:
        with pytest.raises(ValueError, match="needs the token id of every row"):
            moe(x[0], LocalExperts(), layer_id)
        other = moe(x[0], LocalExperts(), layer_id, token_ids[0].roll(1))  # a row/id misalignment shows
        assert (other - got).abs().max() > 1e-3


def test_the_mtp_layer_is_never_hash_routed(configs):
    ours, _ = configs
    assert v4_moe(ours, 0).gate.hashed and not v4_moe(ours, ours.num_hidden_layers).gate.hashed
