"""What a checkpoint tensor is, by its name: its weight class, the routed expert it belongs to, which rank of
an expert-parallel group owns it, and whether a DeepSeek FP8 checkpoint stores it block-quantized.

The loader (what a rank reads) and the capacity plan (`dsa-serve plan`, what a rank would read) both answer
these questions here, so the plan's per-rank bytes are the loader's by construction.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

WEIGHT_CLASSES = ("attention", "dense_mlp", "router", "shared_experts", "routed_experts", "embeddings", "mtp")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FP8_EXEMPT = ("mlp.gate.weight", "indexer.weights_proj.weight", "eh_proj.weight", "shared_head.head.weight")


def layer_of(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def expert_of(name: str) -> int | None:
    """The routed expert of a per-expert checkpoint tensor (`...mlp.experts.{e}.up_proj.weight`), else None."""
    match = _PER_EXPERT.search(name)
    return int(match.group(1)) if match else None


def is_fused_experts(name: str) -> bool:
    """Stacked experts in one tensor (`...mlp.experts.gate_up_proj` [E, 2I, hidden], `...down_proj`)."""
    return _FUSED_EXPERTS.search(name) is not None


def is_routed_expert(name: str) -> bool:
    return expert_of(name) is not None or is_fused_experts(name)


def weight_class(name: str, num_hidden_layers: int) -> str:
    """One of WEIGHT_CLASSES. Layer norms count with attention; every tensor of an MTP layer is `mtp`."""
    layer = layer_of(name)
    if layer is None:
        return "embeddings"  # embed_tokens, the final norm, lm_head
    if layer >= num_hidden_layers:
        return "mtp"
    if is_routed_expert(name):
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    return "attention"


def owned_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Rank `ep_rank` owns the contiguous block [r·E/ep, (r+1)·E/ep) of every MoE layer's routed experts."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must be in 0..{ep_size - 1} (ep_size={ep_size})")
    if num_experts % ep_size:
        raise ValueError(f"n_routed_experts={num_experts} does not split evenly over ep_size={ep_size}"
                         f" ({num_experts} % {ep_size} = {num_experts % ep_size}); choose an ep_size dividing it")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def fp8_quantized(name: str, not_converted: Iterable[str] = ()) -> bool:
    """Whether a DeepSeek-style FP8 checkpoint stores this tensor as FP8 blocks + `weight_scale_inv`:
    every linear projection and the indexer's wq_b / wk, except the router gate, the indexer's weights_proj,
    the MTP eh_proj and heads, and the modules `quantization_config.modules_to_not_convert` names."""
    if not name.endswith(".weight") or name.endswith(_FP8_EXEMPT) or name.startswith("lm_head"):
        return False
    if any(module and module in name for module in not_converted):
        return False
    return name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight"))


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def stored_tensor_bytes(name: str, shape: Iterable[int], config_dtype: str = "bfloat16",
                        fp8_block: tuple[int, int] | None = None, not_converted: Iterable[str] = ()) -> int:
    """Bytes a checkpoint stores for tensor `name` of `shape`: config.json's dtype per element, except
    `e_score_correction_bias` (float32); under FP8 (`fp8_block` = weight_block_size) a tensor that
    `fp8_quantized` names takes 1 byte per element plus its float32 `weight_scale_inv` [ceil(out/b0), ceil(in/b1)].
    `config_dtype` is config.json's `torch_dtype` ("bfloat16", "float16", "float32"; "torch." prefix allowed)."""
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if name.endswith("e_score_correction_bias"):
        return 4 * numel
    if fp8_block is not None and len(shape) == 2 and fp8_quantized(name, not_converted):
        rows, cols = shape
        return numel + 4 * math.ceil(rows / fp8_block[0]) * math.ceil(cols / fp8_block[1])
    dtype = str(config_dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"config.json torch_dtype={config_dtype!r} is not supported; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype] * numel


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor a checkpoint stores, as the capacity plan counts it (a family's `checkpoint_tensors`)."""

    name: str
    shape: tuple[int, ...]
    weight_class: str  # one of WEIGHT_CLASSES
    expert: int | None  # the routed expert, None for replicated tensors
    stored_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def checkpoint_dtype(raw: dict) -> str:
    """config.json's `torch_dtype` (or `dtype`) as the plan counts it: bfloat16 when absent."""
    return raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
