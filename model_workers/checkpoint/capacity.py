"""Capacity plan (`dsa-serve plan`): what one rank of a CP group holds, from a checkpoint's config.json alone.

Under expert parallelism (ep_size E over C ranks, E in {1, C}) rank r holds the routed experts
`owned_experts(n, r, E)` of every MoE layer (target and MTP); every other tensor is replicated. The tensor
list is the model's own (`DSAForCausalLM` built on the meta device, split into checkpoint names by
`checkpoint_tensors`), and each tensor's bytes are `stored_tensor_bytes`, the rule the loader counts with.
KV: every rank holds full-layer KV of the requests it owns (DP attention), so bytes per token are per rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from model_workers.checkpoint.saver import checkpoint_tensors
from model_workers.checkpoint.v4_capacity import v4_checkpoint_shapes, v4_stored_bytes
from model_workers.checkpoint.weight_classes import (
    WEIGHT_CLASSES,
    expert_of,
    owned_experts,
    stored_tensor_bytes,
    weight_class,
)
from model_workers.kv_format import key_formats
from model_workers.model.config import ModelConfig, load_model_config
from model_workers.model.decoder import DSAForCausalLM
from model_workers.model.v4_config import V4Config
from model_workers.v4_cache import bytes_per_token, request_bytes

KV_DTYPES = ("bfloat16", "float32", "fp8_e4m3")  # what a plan can count; `auto` (--kv-cache-dtype) is bfloat16
COMPARED_KV_DTYPES = ("bfloat16", "fp8_e4m3")  # the plan reports both side by side


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    shape: tuple[int, ...]
    weight_class: str  # one of WEIGHT_CLASSES
    expert: int | None  # the routed expert, None for replicated tensors
    stored_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def config_path(model_dir: str | Path) -> Path:
    """`model_dir`/config.json, the only file the plan reads."""
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such directory (pass a folder holding config.json)")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json in this folder (only config.json is read)")
    return path


def checkpoint_dtype(raw: dict) -> str:
    """config.json's `torch_dtype` (or `dtype`), bfloat16 when absent."""
    return raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a loader reads, with the released MTP layout (MoE MLP and
    own shared_head.head per MTP layer); the MTP layers' embed_tokens copies, which the loader skips, are not
    listed. Built on the meta device: no memory, no file."""
    with torch.device("meta"):
        model = DSAForCausalLM(config, [(True, True)] * config.num_nextn_predict_layers)
    return {name: tuple(tensor.shape) for name, tensor in checkpoint_tensors(model).items()}


def checkpoint_tensor_list(raw: dict, config: ModelConfig) -> list[CheckpointTensor]:
    """Every checkpoint tensor with its class, routed expert and stored bytes (dtype, FP8 blocks + scales)."""
    dtype = checkpoint_dtype(raw)
    not_converted = tuple((raw.get("quantization_config") or {}).get("modules_to_not_convert") or ())
    layers = config.num_hidden_layers
    if isinstance(config, V4Config):  # release names; classes and experts by our module names
        return [CheckpointTensor(release, shape, weight_class(module, layers), expert_of(module),
                                 v4_stored_bytes(release, module, shape, config, dtype))
                for release, (module, shape) in v4_checkpoint_shapes(config).items()]
    return [
        CheckpointTensor(name, shape, weight_class(name, layers), expert_of(name),
                         stored_tensor_bytes(name, shape, dtype, config.fp8_block_size, not_converted))
        for name, shape in checkpoint_shapes(config).items()
    ]


def check_parallelism(cp_size: int, ep_size: int, num_experts: int) -> None:
    """cp_size >= 1, ep_size in {1, cp_size}, experts splitting evenly (owned_experts' message)."""
    if cp_size < 1:
        raise ValueError(f"--cp-size {cp_size}: must be >= 1 (ranks in the CP group)")
    if ep_size not in (1, cp_size):
        raise ValueError(f"--ep-size {ep_size}: must be 1 (experts replicated) or --cp-size {cp_size} "
                         f"(experts sharded over the CP group); allowed: 1, {cp_size}")
    try:
        owned_experts(num_experts, 0, ep_size)
    except ValueError as exc:
        raise ValueError(f"--ep-size {ep_size}: {exc}") from None


def rank_bytes(tensors: list[CheckpointTensor], num_experts: int, rank: int, ep_size: int) -> dict:
    """What `rank` holds: bytes by weight class, the replicated and routed-expert parts, and their total."""
    owned = owned_experts(num_experts, rank % ep_size, ep_size)
    by_class, routed = dict.fromkeys(WEIGHT_CLASSES, 0), 0
    for tensor in tensors:
        if tensor.expert is None or tensor.expert in owned:
            by_class[tensor.weight_class] += tensor.stored_bytes
            routed += tensor.stored_bytes if tensor.expert is not None else 0
    total = sum(by_class.values())
    return {"rank": rank, "experts": [owned.start, owned.stop], "bytes_by_class": by_class,
            "replicated_bytes": total - routed, "routed_bytes": routed, "weight_bytes": total}


def plan_kv_dtype(kv_dtype: str) -> str:
    """The KV dtype a plan counts: `auto` is bfloat16 (the activation dtype of the checkpoints plans are for)."""
    resolved = "bfloat16" if kv_dtype == "auto" else kv_dtype
    if resolved not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_dtype!r}: allowed: auto, {', '.join(KV_DTYPES)}")
    return resolved


def kv_layer_bytes(config: ModelConfig, kv_dtype: str) -> tuple[int, int]:
    """(latent bytes, indexer-key bytes) per token per cache layer, from the cache's own formats (kv_format.py):
    fp8_e4m3 is DESIGN §10's layout (c_kv FP8 + one fp32 scale per 128 values, k_pe bf16; indexer key FP8 + one
    fp32 scale per 128 values)."""
    kv_dtype = plan_kv_dtype(kv_dtype)
    weights = torch.float32 if kv_dtype == "float32" else torch.bfloat16
    latent, index = key_formats("auto" if kv_dtype == "float32" else kv_dtype, weights, config.kv_lora_rank,
                                config.qk_rope_head_dim, config.index_head_dim)
    return latent.bytes_per_token, index.bytes_per_token


def indexed_cache_layers(config: ModelConfig) -> list[bool]:
    """Per cache layer (target layers, then MTP layers): does it cache an indexer key? (as ModelRunner)."""
    return [t == "full" for t in config.indexer_types] + [True] * config.num_nextn_predict_layers


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """Σ over cache layers of latent bytes + index-key bytes (on layers with an indexer)."""
    latent, index = kv_layer_bytes(config, kv_dtype)
    return sum(latent + (index if has_index else 0) for has_index in indexed_cache_layers(config))


def cache_bytes_per_token(config: ModelConfig | V4Config, kv_dtype: str) -> float:
    """Bytes of KV pages one token of context costs on its owner, either family (V4: its compressed entries)."""
    if isinstance(config, V4Config):
        return bytes_per_token(config, {"float32": 4, "bfloat16": 2}[plan_kv_dtype(kv_dtype)])
    return kv_bytes_per_token(config, kv_dtype)


def kv_tokens_that_fit(device_memory_gib: float, weight_bytes: int, kv_per_token: int) -> tuple[int, bool]:
    """(floor((G·2^30 − weights) / KV bytes per token), weights fit?); (0, False) when they do not."""
    if not device_memory_gib > 0:
        raise ValueError(f"--device-memory-gib {device_memory_gib}: must be > 0 (GiB of one device, 141 for H200)")
    free = math.floor(device_memory_gib * 2**30) - weight_bytes
    return (free // kv_per_token, True) if free >= 0 else (0, False)


def param_counts(tensors: list[CheckpointTensor]) -> dict[str, int]:
    """Parameter counts: all tensors and the routed experts (target + MTP layers), the MTP layers' share, and
    the target model alone (what model cards quote: DeepSeek-V3.2 671.9 B, GLM-5 743.9 B)."""
    mtp = [t for t in tensors if t.weight_class == "mtp"]
    total, routed = sum(t.numel for t in tensors), sum(t.numel for t in tensors if t.expert is not None)
    mtp_total, mtp_routed = sum(t.numel for t in mtp), sum(t.numel for t in mtp if t.expert is not None)
    return {"total": total, "routed_experts": routed, "mtp_layers": mtp_total, "mtp_routed_experts": mtp_routed,
            "target_model": total - mtp_total, "target_routed_experts": routed - mtp_routed}


def checkpoint_summary(raw: dict, config: ModelConfig, ep_size: int, tensors: list[CheckpointTensor]) -> dict:
    return {
        "dtype": checkpoint_dtype(raw),
        "fp8_block_size": list(config.fp8_block_size) if config.fp8_block_size else None,
        "num_hidden_layers": config.num_hidden_layers,
        "num_mtp_layers": config.num_nextn_predict_layers,
        "n_routed_experts": config.n_routed_experts,
        "experts_per_rank": config.n_routed_experts // ep_size,
        "num_tensors": len(tensors),
    }


def plan(model_dir: str | Path, cp_size: int, ep_size: int, kv_cache_dtype: str = "auto",
         device_memory_gib: float | None = None) -> dict:
    """The capacity plan as a JSON-able dict (bytes are exact integers; ranks 0..cp_size-1)."""
    kv_cache_dtype = plan_kv_dtype(kv_cache_dtype)
    path = config_path(model_dir)
    config = load_model_config(model_dir)
    raw = json.loads(path.read_text())
    check_parallelism(cp_size, ep_size, config.n_routed_experts)
    if isinstance(config, V4Config):
        return v4_plan(model_dir, raw, config, cp_size, ep_size, kv_cache_dtype, device_memory_gib)
    kv_per_token = kv_bytes_per_token(config, kv_cache_dtype)
    if device_memory_gib is not None:
        kv_tokens_that_fit(device_memory_gib, 0, kv_per_token)  # validates G before the model is built
    tensors = checkpoint_tensor_list(raw, config)
    latent, index = kv_layer_bytes(config, kv_cache_dtype)
    indexed = indexed_cache_layers(config)
    out = weights_plan(model_dir, raw, config, cp_size, ep_size, kv_cache_dtype, device_memory_gib, tensors)
    out.update(kv={"cache_layers": len(indexed), "indexed_layers": sum(indexed), "latent_bytes_per_layer": latent,
                   "index_bytes_per_layer": index}, kv_bytes_per_token=kv_per_token)
    if device_memory_gib is not None:
        fit, weights_fit = kv_tokens_that_fit(device_memory_gib, out["max_rank_weight_bytes"], kv_per_token)
        out.update(kv_tokens_that_fit=fit, weights_fit=weights_fit)
    out["kv_by_dtype"] = kv_dtype_comparison(config, out["max_rank_weight_bytes"], device_memory_gib)
    return out


def kv_dtype_comparison(config: ModelConfig, weight_bytes: int = 0, device_memory_gib: float | None = None) -> dict:
    """bfloat16 and fp8_e4m3 side by side: KV bytes per token per rank, the tokens one GiB of cache holds, the KV
    tokens that fit (with a device size) and the FP8 token-capacity gain (= the ratio of bytes per token)."""
    out = {}
    for kv_dtype in COMPARED_KV_DTYPES:
        per_token = kv_bytes_per_token(config, kv_dtype)
        entry = {"kv_bytes_per_token": per_token, "tokens_per_gib": 2**30 // per_token}
        if device_memory_gib is not None:
            entry["kv_tokens_that_fit"] = kv_tokens_that_fit(device_memory_gib, weight_bytes, per_token)[0]
        out[kv_dtype] = entry
    bf16, fp8 = (out[d]["kv_bytes_per_token"] for d in COMPARED_KV_DTYPES)
    out["fp8_capacity_gain"] = round(bf16 / fp8, 4)
    return out


def weights_plan(model_dir, raw: dict, config, cp_size: int, ep_size: int, kv_cache_dtype: str,
                 device_memory_gib: float | None, tensors: list[CheckpointTensor]) -> dict:
    """The plan's model, inputs, checkpoint and per-rank weight parts (both families)."""
    ranks = [rank_bytes(tensors, config.n_routed_experts, r, ep_size) for r in range(cp_size)]
    totals = [rank["weight_bytes"] for rank in ranks]
    return {
        "model": str(model_dir),
        "model_type": config.model_type,
        "inputs": {"cp_size": cp_size, "ep_size": ep_size, "kv_cache_dtype": kv_cache_dtype,
                   "device_memory_gib": device_memory_gib},
        "checkpoint": checkpoint_summary(raw, config, ep_size, tensors),
        "params": param_counts(tensors),
        "total_checkpoint_bytes": sum(t.stored_bytes for t in tensors),
        "replicated_bytes": ranks[0]["replicated_bytes"],
        "ranks": ranks,
        "per_rank_weight_bytes": totals,
        "max_rank_weight_bytes": max(totals),
    }


def v4_plan(model_dir, raw: dict, config: V4Config, cp_size: int, ep_size: int, kv_cache_dtype: str,
            device_memory_gib: float | None) -> dict:
    """DeepSeek-V4: KV grows by the compressed entries only (`bytes_per_token`); each request also holds a
    bounded state (window tails, open compressor windows: `request_bytes`)."""
    if kv_cache_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not available for deepseek_v4 yet; "
                         f"allowed: auto, bfloat16, float32")
    width = {"float32": 4, "bfloat16": 2}[kv_cache_dtype]
    tensors = checkpoint_tensor_list(raw, config)
    out = weights_plan(model_dir, raw, config, cp_size, ep_size, kv_cache_dtype, device_memory_gib, tensors)
    per_token = bytes_per_token(config, width)
    out.update(kv={"layer_types": {t: config.layer_types.count(t) for t in sorted(set(config.layer_types))},
                   "request_state_bytes": request_bytes(config, config.num_nextn_predict_layers, width)},
               kv_bytes_per_token=per_token)
    if device_memory_gib is not None:
        fit, weights_fit = kv_tokens_that_fit(device_memory_gib, out["max_rank_weight_bytes"], math.ceil(per_token))
        out.update(kv_tokens_that_fit=fit, weights_fit=weights_fit)
    return out
