"""Random DeepSeek-V4 checkpoints of a named shape, written as the release writes them (release names, a release
config.json): what `bench prefill` and `plan` run on where no real V4 checkpoint fits (no weights are downloaded).

The weights are random (matrices N(0, 0.02²), unit norms, zero sinks / position biases / routing bias, hc scales
1, a random distinct expert set per token for `tid2eid`): speed and memory are the real architecture's, the
text is noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from model_workers.checkpoint.saver import checkpoint_tensors
from model_workers.models.deepseek_v4.names import release_name
from model_workers.models.deepseek_v4.config import parse_v4_config
from model_workers.models.deepseek_v4.model import DeepseekV4ForCausalLM

_COMMON = dict(model_type="deepseek_v4", num_key_value_heads=1, n_shared_experts=1, rope_theta=10000.0,
               compress_rope_theta=160000.0, routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6,
               hc_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, scoring_func="sqrtsoftplus",
               hidden_act="silu", max_position_embeddings=65536,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1})
SHAPES = {
    # V4-Flash's proportions scaled down: window 128, CSA rate 4 / HCA rate 128, 4 hc streams, 20 Sinkhorn
    # iterations, sliding first layers, hash routing on the first layers, a trailing MTP entry.
    "small": dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128, o_groups=4,
                  o_lora_rank=64, sliding_window=128, index_n_heads=16, index_head_dim=64, index_topk=128,
                  hc_mult=4, hc_sinkhorn_iters=20, n_routed_experts=8, num_experts_per_tok=2,
                  compress_ratios=[0, 4, 128, 4, 128, 4, 0], num_hash_layers=2, num_nextn_predict_layers=1),
}


def shape_config(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r}: allowed: {', '.join(SHAPES)}")
    return {**_COMMON, **SHAPES[shape]}


def write_random_v4(out_dir: str | Path, shape: str = "small", seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    raw = shape_config(shape)
    config = parse_v4_config(raw)
    model = DeepseekV4ForCausalLM(config, raw["num_nextn_predict_layers"])
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in checkpoint_tensors(model).items():
        value = _random(name, tensor, generator, config.n_routed_experts)
        tensors[release_name(name, config.num_hidden_layers)] = value if not value.is_floating_point() or \
            value.dtype == torch.float32 and _keeps_float32(name) else value.to(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out_dir


def _keeps_float32(name: str) -> bool:
    return name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or "_hc." in name or "hc_head." in name


def _random(name: str, tensor: torch.Tensor, generator: torch.Generator, num_experts: int) -> torch.Tensor:
    shape, leaf = tuple(tensor.shape), name.rsplit(".", 1)[-1]
    if tensor.dtype == torch.long:  # tid2eid [vocab, k]: distinct experts per token
        return torch.stack([torch.randperm(num_experts, generator=generator)[: shape[1]] for _ in range(shape[0])])
    if leaf in ("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias"):
        return torch.zeros(shape)
    if leaf in ("scale", "hc_scale") or (len(shape) == 1 and "norm" in name):
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02
