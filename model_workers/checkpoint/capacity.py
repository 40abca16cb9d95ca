"""Capacity plan (`dsa-serve plan`): what one rank of a CP group holds, from a checkpoint's config.json alone.

Under expert parallelism (ep_size E over C ranks, E in {1, C}) rank r holds the routed experts
`owned_experts(n, r, E)` of every MoE layer (target and MTP); every other tensor is replicated. The tensor
list is the model's own, as its family lists it (`checkpoint_tensors`: the model built on the meta device under
checkpoint names, each tensor's bytes by the rule the loader counts with). KV: every rank holds full-layer KV of
the requests it owns (DP attention), so bytes per token are per rank; the family says what they are.
"""

from __future__ import annotations

import math
from pathlib import Path

from model_workers.checkpoint.model_dir import CONFIG_FILE, read_model_spec
from model_workers.checkpoint.weight_classes import WEIGHT_CLASSES, CheckpointTensor, checkpoint_dtype, owned_experts
from model_workers.models.family import ModelFamily
from model_workers.spec import ModelSpec

PLAN_KV_DTYPES = ("bfloat16", "float32", "fp8_e4m3")  # what a plan can count for some family


def config_path(model_dir: str | Path) -> Path:
    """`model_dir`/config.json, the only file the plan reads."""
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such directory (pass a folder holding config.json)")
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json in this folder (only config.json is read)")
    return path


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


def plan_kv_dtype(kv_dtype: str, family: ModelFamily, model_type: str = "") -> str:
    """The KV dtype a plan counts: `auto` is bfloat16 (the activation dtype of the checkpoints plans are for); a
    ValueError naming the family's allowed values for one it cannot count."""
    resolved = "bfloat16" if kv_dtype == "auto" else kv_dtype
    if resolved not in PLAN_KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_dtype!r}: allowed: auto, {', '.join(PLAN_KV_DTYPES)}")
    if resolved not in family.plan_kv_dtypes:
        allowed = ", ".join(("auto", *family.plan_kv_dtypes))
        raise ValueError(f"--kv-cache-dtype {kv_dtype!r} is not available for {model_type or family.name} yet; "
                         f"allowed: {allowed}")
    return resolved


def cache_bytes_per_token(model: ModelSpec, kv_dtype: str) -> float:
    """Bytes of KV pages one token of context costs on its owner (`kv_dtype` a plan or --kv-cache-dtype name)."""
    family = model.family
    return family.cache_bytes_per_token(model.config, plan_kv_dtype(kv_dtype, family, model.config.model_type))


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


def checkpoint_summary(raw: dict, config, ep_size: int, tensors: list[CheckpointTensor]) -> dict:
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
    config_path(model_dir)
    model = read_model_spec(model_dir)
    family, config = model.family, model.config
    kv_dtype = plan_kv_dtype(kv_cache_dtype, family, config.model_type)
    check_parallelism(cp_size, ep_size, config.n_routed_experts)
    if device_memory_gib is not None:
        kv_tokens_that_fit(device_memory_gib, 0, 1)  # validates G before the model is built
    tensors = family.checkpoint_tensors(model.raw, config)
    out = weights_plan(model_dir, model.raw, config, cp_size, ep_size, kv_dtype, device_memory_gib, tensors)
    out.update(family.kv_plan(config, kv_dtype, out["max_rank_weight_bytes"], device_memory_gib, kv_tokens_that_fit))
    return out


def weights_plan(model_dir, raw: dict, config, cp_size: int, ep_size: int, kv_cache_dtype: str,
                 device_memory_gib: float | None, tensors: list[CheckpointTensor]) -> dict:
    """The plan's model, inputs, checkpoint and per-rank weight parts (every family)."""
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
