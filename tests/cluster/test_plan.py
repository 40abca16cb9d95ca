"""`dsa-serve plan`: per-rank weight bytes under EP, KV bytes per token and the KV tokens that fit, from a folder
holding only config.json. Hand-computed tiny-model bytes, the cache's own bytes_per_token, and the released
DeepSeek-V3.2 / GLM-5 shapes (transformers' config defaults) as oracles."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from cluster import cli
from model_workers.checkpoint.capacity import kv_tokens_that_fit, param_counts, plan, rank_bytes
from model_workers.models.dsa.capacity import checkpoint_tensor_list, kv_bytes_per_token
from model_workers.checkpoint.weight_classes import stored_tensor_bytes
from model_workers.models.dsa.cache import PagedKVCache
from model_workers.kernels.torch.fp8_rows import PlainRows
from model_workers.models.registry import parse_model_config
from support.tiny_models import BASE, SHAPES, reference_model, save_reference

TINY = {**BASE, "model_type": "deepseek_v32", "num_nextn_predict_layers": 1}
# 2 sparse target layers + 1 MTP layer, 8 experts of gate/up [32, 64] and down [64, 32], bf16
TINY_ROUTED_BYTES = 3 * 8 * 3 * 64 * 32 * 2
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}


def config_dir(tmp_path, raw: dict):
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_on_a_folder_holding_only_config_json(tmp_path, capsys):
    folder = config_dir(tmp_path, TINY)
    code, out, _ = run_cli(capsys, "--model", str(folder), "--cp-size", "2", "--ep-size", "2",
                           "--device-memory-gib", "0.001", "--json")
    result = json.loads(out)
    assert code == 0 and [p.name for p in folder.iterdir()] == ["config.json"]
    assert result["inputs"] == {"cp_size": 2, "ep_size": 2, "kv_cache_dtype": "bfloat16", "device_memory_gib": 0.001}
    assert [r["experts"] for r in result["ranks"]] == [[0, 4], [4, 8]]
    assert result["per_rank_weight_bytes"] == [r["weight_bytes"] for r in result["ranks"]]
    assert result["max_rank_weight_bytes"] == max(result["per_rank_weight_bytes"])
    assert result["params"]["routed_experts"] == TINY_ROUTED_BYTES // 2
    assert result["total_checkpoint_bytes"] == 2 * result["params"]["total"] + 3 * 8 * 2  # bf16; fp32 bias
    assert result["weights_fit"] is True and result["kv_tokens_that_fit"] > 0


def test_cli_table_without_json(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "--model", str(config_dir(tmp_path, TINY)), "--cp-size", "2", "--ep-size", "1")
    assert code == 0 and "routed_experts" in out and "B per token per rank" in out and "KV tokens fit" not in out


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_ep_equal_cp_is_replicated_plus_routed_over_cp(tmp_path, cp_size):
    folder = config_dir(tmp_path, TINY)
    sharded, replicated = plan(folder, cp_size, cp_size), plan(folder, cp_size, 1)
    assert sharded["replicated_bytes"] == replicated["replicated_bytes"]
    assert replicated["ranks"][0]["routed_bytes"] == TINY_ROUTED_BYTES
    assert replicated["per_rank_weight_bytes"] == [replicated["total_checkpoint_bytes"]] * cp_size
    for rank in sharded["ranks"]:
        assert rank["routed_bytes"] == TINY_ROUTED_BYTES // cp_size
        assert rank["weight_bytes"] == sharded["replicated_bytes"] + TINY_ROUTED_BYTES // cp_size
        # the MTP layer's experts count under mtp: 1 of the 3 MoE layers
        assert rank["bytes_by_class"]["routed_experts"] == 2 * TINY_ROUTED_BYTES // 3 // cp_size


def test_bytes_by_class_by_hand(tmp_path):
    classes = plan(config_dir(tmp_path, TINY), 2, 2)["ranks"][1]["bytes_by_class"]
    assert classes["router"] == 2 * (8 * 64 * 2 + 8 * 4)  # gate weight bf16 + e_score_correction_bias fp32
    assert classes["embeddings"] == 2 * 128 * 64 * 2 + 64 * 2  # embed_tokens, lm_head, final norm
    assert classes["dense_mlp"] == 3 * 64 * 96 * 2
    assert classes["shared_experts"] == 2 * 3 * 64 * 32 * 2


@pytest.mark.parametrize("kind", ["v32", "glm_shared"])
def test_tensor_names_and_shapes_are_the_transformers_checkpoint(tmp_path, kind):
    """Without MTP layers the plan lists exactly the tensors `save_pretrained` writes, with their shapes."""
    from safetensors import safe_open

    folder = save_reference(reference_model(kind).to(torch.bfloat16), tmp_path / kind)
    raw = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert {t.name: t.shape for t in checkpoint_tensor_list(raw, parse_model_config(raw))} == saved


@pytest.mark.parametrize(("argv", "message"), [
    (["--cp-size", "2", "--ep-size", "3"], "--ep-size 3: must be 1 (experts replicated) or --cp-size 2"),
    (["--cp-size", "3", "--ep-size", "3"], "--ep-size 3: n_routed_experts=8 does not split evenly over ep_size=3"),
    (["--cp-size", "0", "--ep-size", "1"], "--cp-size 0: must be >= 1"),
    (["--cp-size", "2", "--ep-size", "2", "--device-memory-gib", "0"], "--device-memory-gib 0.0: must be > 0"),
])
def test_user_errors_exit_2_with_one_line(tmp_path, capsys, argv, message):
    code, out, err = run_cli(capsys, "--model", str(config_dir(tmp_path, TINY)), *argv)
    assert code == 2 and out == "" and err.startswith(f"dsa-serve plan: error: {message}") and err.count("\n") == 1


def test_unknown_kv_cache_dtype_is_refused_by_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(capsys, "--model", str(config_dir(tmp_path, TINY)), "--cp-size", "2", "--ep-size", "2",
                "--kv-cache-dtype", "int8")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'int8' (choose from 'auto', 'bfloat16', 'fp8_e4m3')" in err


def test_missing_folder_or_config_json(tmp_path, capsys):
    code, _, err = run_cli(capsys, "--model", str(tmp_path / "absent"), "--cp-size", "1", "--ep-size", "1")
    assert code == 2 and "no such directory" in err
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json in this folder"):
        plan(tmp_path / "weights_only", 1, 1)


def test_stored_tensor_bytes_fp8_blocks_and_scales():
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert stored_tensor_bytes(q_b, (128, 48), "bfloat16", (16, 16)) == 128 * 48 + 4 * 8 * 3
    assert stored_tensor_bytes(q_b, (130, 48), "bfloat16", (16, 16)) == 130 * 48 + 4 * 9 * 3  # ceil
    assert stored_tensor_bytes(q_b, (128, 48), "torch.float32") == 4 * 128 * 48
    assert stored_tensor_bytes("model.layers.1.mlp.gate.weight", (8, 64), "bfloat16", (16, 16)) == 2 * 8 * 64
    assert stored_tensor_bytes("model.layers.1.mlp.gate.e_score_correction_bias", (8,), "bfloat16") == 32
    assert stored_tensor_bytes(q_b, (128, 48), "bfloat16", (16, 16), ["self_attn"]) == 2 * 128 * 48
    with pytest.raises(ValueError, match="torch_dtype='int4' is not supported"):
        stored_tensor_bytes(q_b, (128, 48), "int4")


def test_fp8_config_counts_fp8_bytes_and_scales(tmp_path):
    fp8 = plan(config_dir(tmp_path, {**TINY, "quantization_config": FP8}), 2, 1)
    # per expert: gate, up [32, 64] and down [64, 32] at 1 byte + (2·4 + 2·4 + 4·2) fp32 scales
    assert fp8["ranks"][0]["routed_bytes"] == TINY_ROUTED_BYTES // 2 + 3 * 8 * 24 * 4
    assert fp8["checkpoint"]["fp8_block_size"] == [16, 16]
    keep = {**FP8, "modules_to_not_convert": ["shared_experts"]}
    kept = plan(config_dir(tmp_path / "keep", {**TINY, "quantization_config": keep}), 2, 1)
    assert kept["ranks"][0]["bytes_by_class"]["shared_experts"] == 2 * 3 * 64 * 32 * 2
    assert fp8["ranks"][0]["bytes_by_class"]["shared_experts"] == 2 * (3 * 64 * 32 + 3 * 8 * 4)


@pytest.mark.parametrize("kind", ["v32", "glm_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_equal_the_paged_cache(kind, dtype):
    config = parse_model_config({**BASE, **SHAPES[kind], "num_nextn_predict_layers": 1})
    indexed = [t == "full" for t in config.indexer_types] + [True]
    cache = PagedKVCache(1, 1, PlainRows(config.latent_dim, dtype), PlainRows(config.index_head_dim, dtype), indexed)
    assert kv_bytes_per_token(config, str(dtype).removeprefix("torch.")) == cache.bytes_per_token()


def test_kv_tokens_that_fit_arithmetic(tmp_path):
    assert kv_tokens_that_fit(1.0, 2**30 - 1000, 100) == (10, True)
    assert kv_tokens_that_fit(1.0, 2**30 - 999, 100) == (9, True)
    assert kv_tokens_that_fit(1.0, 2**30, 100) == (0, True)
    assert kv_tokens_that_fit(1.0, 2**30 + 1, 100) == (0, False)
    result = plan(config_dir(tmp_path, TINY), 2, 2, "float32", 0.002)
    free = math.floor(0.002 * 2**30) - result["max_rank_weight_bytes"]
    assert result["kv_bytes_per_token"] == 4 * (4 * (32 + 16) + 4 * 32)
    assert result["kv_tokens_that_fit"] == free // result["kv_bytes_per_token"]
    small = plan(config_dir(tmp_path / "small", TINY), 2, 2, device_memory_gib=1e-6)
    assert (small["kv_tokens_that_fit"], small["weights_fit"]) == (0, False)


def test_plan_puts_bf16_and_fp8_side_by_side(tmp_path, capsys):
    folder = config_dir(tmp_path, TINY)
    result = plan(folder, 2, 2, "fp8_e4m3", 0.002)
    free = math.floor(0.002 * 2**30) - result["max_rank_weight_bytes"]
    fp8_per_token = 4 * ((32 + 4 + 2 * 16) + (32 + 4))  # 4 cache layers: c_kv FP8 + scale, k_pe bf16; index key
    assert result["inputs"]["kv_cache_dtype"] == "fp8_e4m3" and result["kv_bytes_per_token"] == fp8_per_token
    by_dtype = result["kv_by_dtype"]
    assert by_dtype["bfloat16"]["kv_bytes_per_token"] == 4 * 2 * (32 + 16 + 32)
    assert by_dtype["fp8_e4m3"] == {"kv_bytes_per_token": fp8_per_token, "tokens_per_gib": 2**30 // fp8_per_token,
                                    "kv_tokens_that_fit": free // fp8_per_token}
    assert by_dtype["fp8_capacity_gain"] == round(640 / fp8_per_token, 4)
    assert plan(folder, 2, 2, "auto")["inputs"]["kv_cache_dtype"] == "bfloat16"  # auto: the checkpoints' bf16
    code, out, _ = run_cli(capsys, "--model", str(folder), "--cp-size", "2", "--ep-size", "2",
                           "--kv-cache-dtype", "fp8_e4m3", "--device-memory-gib", "0.002")
    assert code == 0 and f"fp8_e4m3 {fp8_per_token} B/token, {free // fp8_per_token:,} tokens fit" in out
    assert f"FP8 holds {640 / fp8_per_token:.2f}x the tokens" in out


def released(config_cls) -> dict:
    raw = config_cls().to_dict()
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    return {**raw, "quantization_config": quant, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("name", "target", "target_routed", "kv_bf16", "kv_fp8"), [
    ("DeepseekV32Config", 671.88e9, 653.91e9, 62 * 1408, 62 * (656 + 132)),
    ("GlmMoeDsaConfig", 743.91e9, 724.78e9, 79 * 1408, 79 * (656 + 132)),
])
def test_released_shapes(name, target, target_routed, kv_bf16, kv_fp8):
    import transformers

    raw = released(getattr(transformers, name))
    config = parse_model_config(raw)
    start = time.perf_counter()
    tensors = checkpoint_tensor_list(raw, config)
    assert time.perf_counter() - start < 30  # meta device: no memory, a few seconds
    params = param_counts(tensors)
    assert params["target_model"] == pytest.approx(target, abs=0.01e9)
    assert params["target_routed_experts"] == pytest.approx(target_routed, abs=0.01e9)
    assert params["routed_experts"] == params["target_routed_experts"] + 256 * 3 * config.hidden_size * 2048
    per_rank = [rank_bytes(tensors, 256, r, 8)["weight_bytes"] for r in range(8)]
    everything = rank_bytes(tensors, 256, 0, 1)
    assert len(set(per_rank)) == 1 and everything["weight_bytes"] == sum(t.stored_bytes for t in tensors)
    assert per_rank[0] == everything["replicated_bytes"] + everything["routed_bytes"] // 8
    if name == "DeepseekV32Config":  # docs/capacity.md: 105.4 GB per rank at EP = 8, 687.6 GB at EP = 1
        assert 100e9 < per_rank[0] < 110e9 and 660e9 < everything["weight_bytes"] < 700e9
    assert (kv_bytes_per_token(config, "bfloat16"), kv_bytes_per_token(config, "fp8_e4m3")) == (kv_bf16, kv_fp8)
