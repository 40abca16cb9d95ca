"""Tiny random DSA checkpoints built with the `transformers` reference classes (the correctness oracle), and the
reference's log-softmax of a sequence."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=16,
    qk_nope_head_dim=16,
    index_topk=8,
    index_head_dim=32,
    index_n_heads=8,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    bos_token_id=0,
    eos_token_id=None,  # decode comparisons run the full length; EOS handling has its own tests
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}

SHAPES = {
    "v32": dict(model_type="deepseek_v32"),
    "v32_yarn": dict(model_type="deepseek_v32", rope_parameters=YARN, tie_word_embeddings=True, index_topk=12),
    "glm_shared": dict(model_type="glm_moe_dsa", num_hidden_layers=4,
                       indexer_types=["full", "shared", "full", "shared"], n_group=1, topk_group=1, index_topk=6),
}


def reference_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of the given shape, with a non-zero e_score_correction_bias."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    spec = {**BASE, **SHAPES[kind], **overrides}
    model_type = spec.pop("model_type")
    config_cls, model_cls = {
        "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
        "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**spec)).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
        for name, param in model.named_parameters():  # larger weights: sharper routing and attention
            if param.dim() >= 2:
                param.mul_(3.0)
    return model


def reference_logprobs(ref, prompt: list[int], tokens: list[int], top: int) -> list[tuple[float, int, list, list]]:
    """Per token of `tokens` after `prompt`: its log-softmax under the reference, its 1-based rank (1 + how many
    are likelier), and the `top` most likely (ids, values). Prompt logprobs: prompt[:1] then prompt[1:]."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0].double()  # [L, V]
    logprobs = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)  # [n, V]
    best = logprobs.topk(top)  # top = 0: empty [n, 0]
    return [(float(row[t]), int((row > row[t]).sum()) + 1, ids.tolist(), values.tolist())
            for row, t, ids, values in zip(logprobs, tokens, best.indices, best.values)]


def save_reference(model, out_dir: Path) -> Path:
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def add_mtp_layer(model_dir: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """Appends random MTP weights at model.layers.{N} (copied shapes from the last layer) and returns them."""
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    n = config["num_hidden_layers"]
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    mtp = {}
    # The MTP layer is a full DSA layer: it takes the last layer's shapes, and the indexer shapes of the last
    # layer that has one (GLM "shared" layers have none).
    full = max(i for i in range(n) if f"model.layers.{i}.self_attn.indexer.wk.weight" in tensors)
    sources = {k: v for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    sources.update({k.replace(f"layers.{full}.", f"layers.{n - 1}."): v for k, v in tensors.items()
                    if k.startswith(f"model.layers.{full}.self_attn.indexer.")})
    for name, value in sorted(sources.items()):
        if name.startswith(f"model.layers.{n - 1}."):
            new_name = name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")
            if "norm" in name and value.dim() == 1 and "bias" not in name:
                mtp[new_name] = 1.0 + 0.1 * torch.randn(value.shape, generator=generator)
            else:
                mtp[new_name] = torch.randn(value.shape, generator=generator) * value.std()
    mtp[f"model.layers.{n}.enorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    mtp[f"model.layers.{n}.hnorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    tensors.update(mtp)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return mtp


TRAINING_CONFIG = {  # a model small enough to train for a few steps in a test
    "model_type": "deepseek_v32", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": 16,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "index_n_heads": 8,
    "index_head_dim": 16, "index_topk": 6, "tie_word_embeddings": True,
}


def tiny_training_model(seed: int = 0, with_mtp: bool = True):
    """Our DSAForCausalLM over TRAINING_CONFIG (one MTP layer unless `with_mtp` is False), random weights."""
    from model_workers.checkpoint.saver import init_weights
    from model_workers.models.registry import parse_model_config
    from model_workers.models.dsa.model import DSAForCausalLM

    model = DSAForCausalLM(parse_model_config(TRAINING_CONFIG), mtp_layout=[(True, False)] if with_mtp else [])
    init_weights(model, std=0.3, seed=seed)
    return model
