"""`bench kv-cache`: FP8 against bf16 on held-out prompts of the shipped model, and the bytes of both caches."""

import json

from cluster import cli


def test_fp8_agrees_with_bf16_and_its_bytes_equal_the_formula(capsys):
    code = cli.main(["bench", "kv-cache", "--prompts", "2", "--prompt-len", "48", "--max-tokens", "24", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["positions"] == 2 * 24
    assert result["top1_agreement"] >= 0.9 and 0 < result["mean_abs_delta_logprob"] < 0.1
    # the shipped model: 4 target layers + 1 MTP layer, all indexed; c_kv 64, k_pe 32, index key 32
    assert result["kv"]["bfloat16"]["measured_kv_bytes_per_token"] == 5 * 2 * (64 + 32 + 32) == 1280
    assert result["kv"]["fp8_e4m3"]["measured_kv_bytes_per_token"] == 5 * ((64 + 4 + 2 * 32) + (32 + 4)) == 840
    for entry in result["kv"].values():
        assert entry["measured_kv_bytes_per_token"] == entry["formula_kv_bytes_per_token"]
    assert result["fp8_capacity_gain"] == round(1280 / 840, 4)
    assert result["command"].startswith("dsa-serve bench kv-cache --prompts 2")
