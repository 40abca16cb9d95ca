"""`cluster/bench/flops.py`: the prefill FLOP count against a hand computation, the efficiency it gives, the GEMM
rate, and the efficiency table the harness's report (benchmarks/report.py) shows for `bench prefill` results."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.bench.flops import checkpoint_flop_config, flop_efficiency, gemm_flops_per_s
from model_workers.models.dsa.flops import causal_pairs, prefill_flops, sparse_keys
from benchmarks.cli import main
from model_workers.models.registry import parse_model_config

TINY = {  # layer 0 dense, layer 1 MoE, one MTP layer: every term of the count is exercised
    "model_type": "deepseek_v32", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
    "moe_intermediate_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 6, "kv_lora_rank": 4,
    "qk_nope_head_dim": 3, "qk_rope_head_dim": 2, "v_head_dim": 3, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "index_n_heads": 2, "index_head_dim": 4, "index_topk": 3,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 64,
}


def test_prefill_flops_equal_a_hand_count_on_a_tiny_config():
    flops = prefill_flops(parse_model_config(TINY), 5, logit_rows=2)
    parts = flops["parts"]
    # per token and layer, multiply-adds: q_a 8*6 + q_b 6*2*5 + kv_a 8*6 + W_UK 2*3*4 + W_UV 2*4*3 + o_proj 2*3*8 = 252
    assert parts["attention_linears"] == 5 * 3 * 2 * 252  # 2 target layers + the MTP layer
    assert parts["indexer_linears"] == 5 * 3 * 2 * (6 * 2 * 4 + 8 * 4 + 8 * 2)  # wq_b, wk, weights_proj
    dense, moe = 3 * 8 * 16, 8 * 4 + 1 * 3 * 8 * 4 + 2 * 3 * 8 * 4  # gate + shared + 2 routed experts
    assert parts["mlp_linears"] == 5 * 2 * (dense + moe + moe)  # the MTP layer's MLP is an MoE
    assert parts["indexer_scoring"] == 3 * 15 * 2 * 4 * 2  # 15 causal pairs at L = 5, 2 heads x 4 dims
    assert parts["sparse_attention"] == 3 * (1 + 2 + 3 + 3 + 3) * 2 * ((4 + 2) + 4) * 2  # min(3, p + 1) keys
    assert parts["mtp_eh_proj"] == 5 * 2 * 16 * 8
    assert parts["lm_head"] == 2 * 2 * 8 * 10 * 2  # 2 rows, target head and MTP head
    assert flops["total"] == 7560 + 2880 + 10240 + 720 + 1440 + 1280 + 640 == sum(parts.values())
    assert flops["phases"] == {"indexer": 2880 + 720, "attention": 7560 + 1440, "mlp": 10240}


def test_shared_indexer_layers_and_no_mtp_count_only_what_runs():
    config = parse_model_config({**TINY, "model_type": "glm_moe_dsa", "indexer_types": ["full", "shared"],
                                 "num_nextn_predict_layers": 0})
    parts = prefill_flops(config, 5)["parts"]
    assert parts["indexer_scoring"] == 1 * 15 * 2 * 4 * 2 and parts["indexer_linears"] == 5 * 2 * 96
    assert parts["attention_linears"] == 5 * 2 * 2 * 252 and parts["mtp_eh_proj"] == 0
    assert parts["lm_head"] == 2 * 8 * 10


def test_the_mtp_layer_is_counted_when_the_checkpoint_holds_one(tmp_path):
    from safetensors.torch import save_file

    from model_workers.checkpoint.model_dir import resolve_model_dir

    config, mtp_sparse = checkpoint_flop_config(resolve_model_dir(None))  # the shipped model: one MoE MTP layer
    assert config.num_nextn_predict_layers == 1 and mtp_sparse is True
    (tmp_path / "config.json").write_text(json.dumps(TINY))  # declares an MTP layer the weights do not have
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, str(tmp_path / "model.safetensors"))
    config, mtp_sparse = checkpoint_flop_config(tmp_path)
    assert config.num_nextn_predict_layers == 0 and mtp_sparse is None
    assert prefill_flops(config, 5)["layers"] == 2


def test_causal_pairs_and_sparse_keys():
    assert [causal_pairs(n) for n in (1, 2, 5)] == [1, 3, 15]
    assert sparse_keys(2, 3) == 1 + 2 and sparse_keys(5, 3) == 12 and sparse_keys(5, 64) == 15


def test_efficiency_divides_the_count_by_wall_time_and_the_gemm_rates():
    config = parse_model_config(TINY)
    phases = {"indexer": 1.0, "attention": 0.5, "mlp": 2.0, "communication": 0.1, "other": 0.0}
    run = {"wall_s": 2.0, "chunks": 2, "per_rank_phase_s": [phases, phases]}
    gemm = {"rank_threads": 1, "rank": 1000.0, "all": 1500.0}
    block = flop_efficiency(config, 5, run, gemm)
    assert block["model_flops"]["total"] == 24760 and block["cp_size"] == 2 and block["chunks"] == 2
    assert block["efficiency"] == pytest.approx(24760 / (2.0 * 1500.0))
    assert block["phase_efficiency"] == pytest.approx({"indexer": 3600 / (2.0 * 1000), "attention": 9000 / (1.0 * 1000),
                                                       "mlp": 10240 / (4.0 * 1000)})
    assert flop_efficiency(object(), 5, run, gemm)["skipped"]  # e.g. a DeepSeek-V4 config


def test_gemm_rate_is_positive_and_leaves_the_thread_count_as_it_was():
    before = torch.get_num_threads()
    assert gemm_flops_per_s(1, size=64, repeats=2) > 0
    assert torch.get_num_threads() == before


def test_report_shows_the_flop_efficiency_of_prefill_lengths(tmp_path):
    phases = {"indexer": 3.0, "attention": 1.0, "mlp": 0.5, "communication": 0.2, "other": 0.1}
    block = flop_efficiency(parse_model_config(TINY), 5, {"wall_s": 2.0, "chunks": 2, "per_rank_phase_s": [phases] * 2},
                            {"rank_threads": 1, "rank": 1e3, "all": 2e3})
    entry = {"prompt_len": 5, "cp_size": 2, "c1_wall_s": 3.0, "cp_wall_s": 2.0, "strong_scaling_efficiency": 0.75,
             "per_rank_phase_s": [phases, phases], "runs": [], "prefill_flop_efficiency": block}
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "prefill.json").write_text(json.dumps({"bench": "prefill", "cp_size": 2, "lengths": [entry]}))
    assert main(["report", "--results", str(folder), "--out", str(tmp_path / "B.md"),
                 "--plots-dir", str(tmp_path / "plots")]) == 0
    text = (tmp_path / "B.md").read_text()
    assert "| L | C | wall s | model GFLOP | GEMM GFLOP/s rank | GEMM GFLOP/s all | efficiency |" in text
    assert f"| 5 | 2 | 2 | {24760 / 1e9:.4g} | 1e-06 | 2e-06 | {24760 / 4e3:.4g} | 0.6 | 4.5 | 10.24 |" in text
