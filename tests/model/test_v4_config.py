"""DeepSeek-V4 config.json in both forms (transformers' and the release's) folds to what `transformers` folds it to."""

import copy

import pytest

from model_workers.models.dsa.config import ModelConfigError
from model_workers.models.deepseek_v4.config import CSA, HCA, SLIDING, parse_v4_config

TINY = dict(model_type="deepseek_v4", vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=48, o_groups=2, o_lora_rank=16,
            sliding_window=8, index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=5,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=2048,
            rope_theta=10000.0, compress_rope_theta=160000.0)
YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
RELEASE = {**TINY, "compress_ratios": [0, 4, 128, 4, 128, 0, 0], "num_hash_layers": 2, "qk_rope_head_dim": 8,
           "rope_scaling": YARN, "compress_rate_hca": 8}


def hf_form(raw: dict) -> dict:
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**copy.deepcopy(raw)).to_dict()


@pytest.mark.parametrize("form", ["release", "transformers"])
def test_both_forms_fold_like_transformers(form):
    from transformers import DeepseekV4Config

    raw = RELEASE if form == "release" else hf_form({k: v for k, v in RELEASE.items() if k != "compress_ratios"}
                                                     | {"layer_types": hf_form(RELEASE)["layer_types"]})
    ours, theirs = parse_v4_config(raw), DeepseekV4Config(**copy.deepcopy(RELEASE))
    assert ours.layer_types == tuple(theirs.layer_types) == (SLIDING, CSA, HCA, CSA, HCA)  # MTP entries dropped
    assert ours.mlp_layer_types == tuple(theirs.mlp_layer_types) == ("hash_moe",) * 2 + ("moe",) * 3
    assert ours.compress_rates == {CSA: 4, HCA: 8} == dict(theirs.compress_rates)
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim == 8
    compress = theirs.rope_parameters["compress"]
    compress_spec = (ours.compress_rope.rope_type, ours.compress_rope.theta)
    assert compress_spec == ("yarn", compress["rope_theta"]) == ("yarn", 160000.0)
    assert ours.compress_rope.factor == compress["factor"] and ours.compress_rope.attention_factor == 1.0
    assert ours.compress_rope.original_max_position_embeddings == compress["original_max_position_embeddings"]
    assert (ours.main_rope.rope_type, ours.main_rope.theta) == ("default", theirs.rope_parameters["main"]["rope_theta"])
    assert [ours.compress_rate(i) for i in range(6)] == [0, 4, 8, 4, 8, 0]  # layer 5 = the MTP layer: sliding


@pytest.mark.parametrize("change, words", [
    ({"compress_ratios": [0, 4, 16, 4, 128]}, "compress_ratios holds [16]; allowed: 0, 4, 128"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries for 5 layers"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2; allowed: 1"),
    ({"o_groups": 3}, "num_attention_heads=4 must divide into o_groups=3"),
    ({"qk_rope_head_dim": 7}, "both even"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'; allowed: sqrtsoftplus"),
    ({"compress_ratios": None}, "needs layer_types or compress_ratios"),
])
def test_configuration_errors_are_one_line(change, words):
    with pytest.raises(ModelConfigError) as err:
        parse_v4_config({**RELEASE, **change})
    assert words in str(err.value) and "\n" not in str(err.value)
