"""What a DeepSeek-V4 checkpoint stores, tensor by tensor, and what its cache costs, for `dsa-serve plan` and KV
sizing (docs/models.md, 'Checkpoint formats' and 'Cache').

The tensor list is our model's (built on the meta device, with the config's MTP blocks) under release names.
Bytes follow the release's formats: FP8 e4m3 linears (1 byte + one ue8m0 byte per 128×128 block), routed
experts in `expert_dtype` (FP4: half a byte + one ue8m0 byte per 32 inputs of a row), float32 sinks, position
biases, hc parameters and the routing bias, int64 `tid2eid`, everything else in the checkpoint's dtype.
"""

from __future__ import annotations

import math

import torch

from model_workers.checkpoint.saver import checkpoint_tensors
from model_workers.checkpoint.quantized import FP4_GROUP
from model_workers.models.deepseek_v4.names import FP8_RELEASE, release_name
from model_workers.checkpoint.weight_classes import (
    DTYPE_BYTES,
    CheckpointTensor,
    checkpoint_dtype,
    expert_of,
    weight_class,
)
from model_workers.models.deepseek_v4.cache import bytes_per_token, request_bytes
from model_workers.models.deepseek_v4.config import V4Config
from model_workers.models.deepseek_v4.model import DeepseekV4ForCausalLM

PLAN_KV_DTYPES = ("bfloat16", "float32")  # its compressed entries are kept in a float dtype (no FP8 yet)
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
# the byte formulas as the benchmarks print them beside what they measure
V4_GATHER_FORMULA = ("(C-1)/C * L * (layers * head_dim + CSA layers * 4 * (head_dim + index_head_dim)"
                     " + HCA layers * 2 * head_dim) * dtype_bytes (MTP layers in `layers`)")
V4_TOKEN_FORMULA = "(CSA layers * (head_dim + index_head_dim) / 4 + HCA layers * head_dim / 128) * dtype_bytes"
_FLOAT32 = ("attn_sink", "ape", "hc_attn_", "hc_ffn_", "hc_head_", "gate.bias")


def v4_checkpoint_shapes(config: V4Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Release name -> (our module name, shape) of every tensor the loader reads."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, config.num_nextn_predict_layers)
    layers = config.num_hidden_layers
    return {release_name(name, layers): (name, tuple(t.shape)) for name, t in checkpoint_tensors(model).items()}


def v4_stored_bytes(release: str, module: str, shape: tuple[int, ...], config: V4Config, dtype: str) -> int:
    numel = math.prod(shape)
    if release.endswith("tid2eid"):
        return 8 * numel
    if release.rsplit(".", 1)[-1].startswith(_FLOAT32) or release.endswith(_FLOAT32):
        return 4 * numel
    quantized = config.fp8_block_size is not None
    if quantized and expert_of(module) is not None and config.expert_dtype == "fp4":
        rows, cols = shape
        return numel // 2 + rows * math.ceil(cols / FP4_GROUP)
    if quantized and (FP8_RELEASE.search(release) or expert_of(module) is not None):
        rows, cols = shape
        block_rows, block_cols = config.fp8_block_size
        return numel + math.ceil(rows / block_rows) * math.ceil(cols / block_cols)
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"config.json torch_dtype={dtype!r} is not supported; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype] * numel


def checkpoint_tensor_list(raw: dict, config: V4Config) -> list[CheckpointTensor]:
    """Every checkpoint tensor under its release name; classes and experts by our module names."""
    dtype, layers = checkpoint_dtype(raw), config.num_hidden_layers
    return [CheckpointTensor(release, shape, weight_class(module, layers), expert_of(module),
                             v4_stored_bytes(release, module, shape, config, dtype))
            for release, (module, shape) in v4_checkpoint_shapes(config).items()]


def cache_bytes_per_token(config: V4Config, kv_dtype: str) -> float:
    """Amortised bytes one more token of context costs: the compressed entries (`cache.bytes_per_token`)."""
    return bytes_per_token(config, ELEMENT_BYTES[kv_dtype])


def kv_plan(config: V4Config, kv_dtype: str, weight_bytes: int, device_memory_gib: float | None,
            tokens_that_fit) -> dict:
    """The plan's KV part: KV grows by the compressed entries only; each request also holds a bounded state
    (window tails, open compressor windows: `request_bytes`)."""
    width = ELEMENT_BYTES[kv_dtype]
    per_token = bytes_per_token(config, width)
    out = {"kv": {"layer_types": {t: config.layer_types.count(t) for t in sorted(set(config.layer_types))},
                  "request_state_bytes": request_bytes(config, config.num_nextn_predict_layers, width)},
           "kv_bytes_per_token": per_token}
    if device_memory_gib is not None:
        fit, weights_fit = tokens_that_fit(device_memory_gib, weight_bytes, math.ceil(per_token))
        out.update(kv_tokens_that_fit=fit, weights_fit=weights_fit)
    return out


def kv_formulas(kv_dtype: str) -> dict[str, str]:
    """The KV byte formulas (CP prefill gathers, compressed entries per token), as text."""
    return {"kv_gather_formula": V4_GATHER_FORMULA, "kv_token_formula": V4_TOKEN_FORMULA}


def kv_summary(plan: dict) -> str:
    """The plan's KV line: compressed entries per token, and each request's bounded state."""
    kv = plan["kv"]
    layers = ", ".join(f"{count} {kind}" for kind, count in kv["layer_types"].items())
    return (f"KV ({plan['inputs']['kv_cache_dtype']}): {plan['kv_bytes_per_token']:,.1f} B per token per rank of "
            f"compressed entries ({layers}) + {kv['request_state_bytes']:,} B of bounded state per request")
