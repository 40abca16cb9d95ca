"""What a DeepSeek-V4 checkpoint stores, tensor by tensor, for `dsa-serve plan` (../shared/deepseek_v4.md 5.3).

The tensor list is our model's (built on the meta device, with the config's MTP blocks) under release names.
Bytes follow the release's formats: FP8 e4m3 linears (1 byte + one ue8m0 byte per 128×128 block), routed
experts in `expert_dtype` (FP4: half a byte + one ue8m0 byte per 32 inputs of a row), float32 sinks, position
biases, hc parameters and the routing bias, int64 `tid2eid`, everything else in the checkpoint's dtype.
"""

from __future__ import annotations

import math

import torch

from model_workers.checkpoint.saver import checkpoint_tensors
from model_workers.checkpoint.v4_names import FP4_GROUP, FP8_RELEASE, release_name
from model_workers.checkpoint.weight_classes import DTYPE_BYTES, expert_of
from model_workers.model.v4_config import V4Config
from model_workers.model.v4_model import DeepseekV4ForCausalLM

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
