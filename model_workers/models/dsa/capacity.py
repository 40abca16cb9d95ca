"""What a DSA checkpoint stores and what its KV cache costs, for the capacity plan (`dsa-serve plan`) and for KV
sizing: tensor by tensor from the model built on the meta device (no memory, no file), KV bytes from the cache's
own key formats."""

from __future__ import annotations

import torch

from model_workers.checkpoint.saver import checkpoint_tensors as model_tensors
from model_workers.checkpoint.weight_classes import (
    CheckpointTensor,
    checkpoint_dtype,
    expert_of,
    stored_tensor_bytes,
    weight_class,
)
from model_workers.kv_format import key_formats
from model_workers.models.dsa.config import ModelConfig
from model_workers.models.dsa.model import DSAForCausalLM

PLAN_KV_DTYPES = ("bfloat16", "float32", "fp8_e4m3")
# the byte formulas as the benchmarks print them beside what they measure
KV_GATHER_FORMULA = "(C-1)/C * L * layers * (kv_lora_rank + qk_rope_head_dim + index_head_dim) * dtype_bytes"
KV_TOKEN_FORMULA = "layers * (kv_lora_rank + qk_rope_head_dim + index_head_dim) * dtype_bytes (MTP layer included)"
FP8_ROW_FORMULA = ("kv_lora_rank + 4*ceil(kv_lora_rank/128) + 2*qk_rope_head_dim + index_head_dim"
                   " + 4*ceil(index_head_dim/128)")
FP8_GATHER_FORMULA = f"(C-1)/C * L * layers * ({FP8_ROW_FORMULA}) (FP8 bytes and fp32 scales, as stored)"
FP8_TOKEN_FORMULA = f"layers * ({FP8_ROW_FORMULA}) (docs/kv_cache.md, 'FP8 layout'; MTP layer included)"
COMPARED_KV_DTYPES = ("bfloat16", "fp8_e4m3")  # the plan reports both side by side


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a loader reads, with the released MTP layout (MoE MLP and
    own shared_head.head per MTP layer); the MTP layers' embed_tokens copies, which the loader skips, are not
    listed. Built on the meta device: no memory, no file."""
    with torch.device("meta"):
        model = DSAForCausalLM(config, [(True, True)] * config.num_nextn_predict_layers)
    return {name: tuple(tensor.shape) for name, tensor in model_tensors(model).items()}


def checkpoint_tensor_list(raw: dict, config: ModelConfig) -> list[CheckpointTensor]:
    """Every checkpoint tensor with its class, routed expert and stored bytes (dtype, FP8 blocks + scales)."""
    dtype = checkpoint_dtype(raw)
    not_converted = tuple((raw.get("quantization_config") or {}).get("modules_to_not_convert") or ())
    layers = config.num_hidden_layers
    return [
        CheckpointTensor(name, shape, weight_class(name, layers), expert_of(name),
                         stored_tensor_bytes(name, shape, dtype, config.fp8_block_size, not_converted))
        for name, shape in checkpoint_shapes(config).items()
    ]


def kv_layer_bytes(config: ModelConfig, kv_dtype: str) -> tuple[int, int]:
    """(latent bytes, indexer-key bytes) per token per cache layer, from the cache's own formats: fp8_e4m3 is
    docs/kv_cache.md's FP8 layout (c_kv FP8 + one fp32 scale per 128 values, k_pe bf16; indexer key FP8 + one fp32
    scale per 128 values). `kv_dtype` is one of PLAN_KV_DTYPES."""
    weights = torch.float32 if kv_dtype == "float32" else torch.bfloat16
    latent, index = key_formats("auto" if kv_dtype == "float32" else kv_dtype, weights, config.kv_lora_rank,
                                config.qk_rope_head_dim, config.index_head_dim)
    return latent.bytes_per_token, index.bytes_per_token


def indexed_cache_layers(config: ModelConfig) -> list[bool]:
    """Per cache layer (target layers, then MTP layers): does it cache an indexer key? (as cache.make_cache)."""
    return [t == "full" for t in config.indexer_types] + [True] * config.num_nextn_predict_layers


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """Σ over cache layers of latent bytes + index-key bytes (on layers with an indexer)."""
    latent, index = kv_layer_bytes(config, kv_dtype)
    return sum(latent + (index if has_index else 0) for has_index in indexed_cache_layers(config))


def kv_plan(config: ModelConfig, kv_dtype: str, weight_bytes: int, device_memory_gib: float | None,
            tokens_that_fit) -> dict:
    """The plan's KV part: the cache layers and their bytes, bytes per token, the tokens that fit beside
    `weight_bytes` (with a device size), and bfloat16 against fp8_e4m3 side by side."""
    latent, index = kv_layer_bytes(config, kv_dtype)
    indexed = indexed_cache_layers(config)
    per_token = kv_bytes_per_token(config, kv_dtype)
    out = {"kv": {"cache_layers": len(indexed), "indexed_layers": sum(indexed), "latent_bytes_per_layer": latent,
                  "index_bytes_per_layer": index}, "kv_bytes_per_token": per_token}
    if device_memory_gib is not None:
        fit, weights_fit = tokens_that_fit(device_memory_gib, weight_bytes, per_token)
        out.update(kv_tokens_that_fit=fit, weights_fit=weights_fit)
    out["kv_by_dtype"] = kv_dtype_comparison(config, weight_bytes, device_memory_gib, tokens_that_fit)
    return out


def kv_dtype_comparison(config: ModelConfig, weight_bytes: int, device_memory_gib: float | None,
                        tokens_that_fit) -> dict:
    """bfloat16 and fp8_e4m3 side by side: KV bytes per token per rank, the tokens one GiB of cache holds, the KV
    tokens that fit (with a device size) and the FP8 token-capacity gain (= the ratio of bytes per token)."""
    out = {}
    for kv_dtype in COMPARED_KV_DTYPES:
        per_token = kv_bytes_per_token(config, kv_dtype)
        entry = {"kv_bytes_per_token": per_token, "tokens_per_gib": 2**30 // per_token}
        if device_memory_gib is not None:
            entry["kv_tokens_that_fit"] = tokens_that_fit(device_memory_gib, weight_bytes, per_token)[0]
        out[kv_dtype] = entry
    bf16, fp8 = (out[d]["kv_bytes_per_token"] for d in COMPARED_KV_DTYPES)
    out["fp8_capacity_gain"] = round(bf16 / fp8, 4)
    return out


def kv_formulas(kv_dtype: str) -> dict[str, str]:
    """The KV byte formulas (CP prefill gathers, cache bytes per token) for a cache of `kv_dtype`, as text."""
    if kv_dtype == "fp8_e4m3":
        return {"kv_gather_formula": FP8_GATHER_FORMULA, "kv_token_formula": FP8_TOKEN_FORMULA}
    return {"kv_gather_formula": KV_GATHER_FORMULA, "kv_token_formula": KV_TOKEN_FORMULA}


def kv_summary(plan: dict) -> str:
    """The plan's KV line: cache layers x latent bytes + indexed layers x index-key bytes = bytes per token."""
    kv = plan["kv"]
    return (f"KV ({plan['inputs']['kv_cache_dtype']}): {kv['cache_layers']} layers x {kv['latent_bytes_per_layer']} B "
            f"latent + {kv['indexed_layers']} x {kv['index_bytes_per_layer']} B index key"
            f" = {plan['kv_bytes_per_token']:,} B per token per rank")
