"""Helpers of the DeepSeek-V4 tests: every parameter and buffer of a `transformers` module randomised."""

from __future__ import annotations

import torch


def randomized(module, seed: int, num_experts: int | None = None):
    """Normal(0, 1) floats in every weight (RoPE frequency buffers are left alone); integer buffers
    (tid2eid [vocab, k]) get a distinct random expert set per token among `num_experts` (default: 8)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:  # RoPE tables are computed, not weights
                continue
            if tensor.dtype == torch.long:
                experts, top_k = num_experts or 8, tensor.shape[1]
                rows = [torch.randperm(experts, generator=generator)[:top_k] for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return module


# A tiny DeepSeek-V4 with every layer kind: sliding, CSA (rate 4, 8 indexer heads so ReLU ties do not decide
# top-k), HCA (rate 8), hash and learned routing, YaRN touching the small RoPE dims (docs/models.md, 'DeepSeek-V4').
TINY_V4 = dict(
    model_type="deepseek_v4", vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=8, index_head_dim=16, index_topk=3,
    hc_mult=2, hc_sinkhorn_iters=3, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], max_position_embeddings=128, rope_theta=10000.0,
    compress_rope_theta=160000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                                "beta_fast": 32, "beta_slow": 1},
    routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1)


def randomize_v4(model, seed: int, num_experts: int):
    """Every parameter of a V4 model (ours or `transformers`') at a scale that keeps activations sane: matrices
    N(0, 0.08²); sinks, position biases, hc bases N(0, 0.5²); hc scales 1 ± 0.2; norm weights 1 ± 0.1; the
    correction bias N(0, 0.1²); `tid2eid` a distinct random expert set per token. Names decide, so two models
    with the same names get the same values."""
    with torch.no_grad():
        for name, tensor in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if "inv_freq" in name:
                continue
            generator = torch.Generator().manual_seed(seed + sum(map(ord, name)) * 7919)
            tensor.copy_(_random_like(name, tensor, generator, num_experts))
    return model


def _random_like(name: str, tensor: torch.Tensor, generator, num_experts: int) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0):
        return mean + std * torch.randn(tensor.shape, generator=generator)

    leaf = name.rsplit(".", 1)[-1]
    if tensor.dtype == torch.long:
        return torch.stack([torch.randperm(num_experts, generator=generator)[: tensor.shape[1]]
                            for _ in range(tensor.shape[0])])
    if leaf in ("sinks", "position_bias", "base", "hc_base"):
        return normal(0.5)
    if leaf in ("scale", "hc_scale"):
        return normal(0.2 / 1.7, 1.0).clamp(0.8, 1.2)
    if leaf == "e_score_correction_bias":
        return normal(0.1)
    if "norm" in name and leaf == "weight":
        return normal(0.1 / 1.7, 1.0).clamp(0.9, 1.1)
    return normal(0.08)


def hf_v4(raw: dict, seed: int):
    """`transformers`' DeepseekV4ForCausalLM of `raw`, randomised (float32, eager attention, eval)."""
    import copy

    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**copy.deepcopy(raw))
    config._attn_implementation = "eager"
    return randomize_v4(DeepseekV4ForCausalLM(config), seed, raw["n_routed_experts"]).eval()


def ours_like(reference, raw: dict, num_mtp_layers: int = 0):
    """Our DeepseekV4ForCausalLM of `raw` holding `reference`'s weights (the names match one to one)."""
    from model_workers.models.deepseek_v4.config import parse_v4_config
    from model_workers.models.deepseek_v4.model import DeepseekV4ForCausalLM

    ours = DeepseekV4ForCausalLM(parse_v4_config(raw), num_mtp_layers)
    weights = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = ours.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith(f"model.layers.{raw['num_hidden_layers']}.") for k in missing)
    return ours.eval()


class HFMTPReference(torch.nn.Module):
    """DeepSeek-V4's MTP block assembled from `transformers`' own V4 modules (docs/models.md, 'MTP block'), since
    transformers has none: e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(streams_i)) -> one sliding-only,
    learned-routing decoder layer -> its own hc_head and norm -> the target's lm_head."""

    def __init__(self, target, seed: int):
        import copy

        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
            DeepseekV4RotaryEmbedding,
        )

        super().__init__()
        config = copy.deepcopy(target.config)
        config.num_hidden_layers, config.layer_types, config.mlp_layer_types = 1, ["sliding_attention"], ["moe"]
        hidden = config.hidden_size
        self.config = config
        self.block = DeepseekV4DecoderLayer(config, 0)
        self.hc_head = DeepseekV4HyperHead(config)
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(hidden, config.rms_norm_eps) for _ in range(3))
        self.e_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.h_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.rotary = DeepseekV4RotaryEmbedding(config)
        randomize_v4(self, seed, config.n_routed_experts)
        self.eval()

    def our_weights(self, num_layers: int) -> dict[str, torch.Tensor]:
        """This block's weights under our names (`model.layers.{num_layers}.*`)."""
        out = {}
        for name, value in self.state_dict().items():
            if "rotary" in name:
                continue
            out[f"model.layers.{num_layers}." + name.removeprefix("block.")] = value
        return out

    def draft_logits(self, target, ids: list[int]) -> torch.Tensor:
        """Draft logits [T - 1, V] at positions 0..T-2 of `ids` (row i predicts t_{i+2} from t_{i+1} and h_i)."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        captured = {}
        handle = target.model.hc_head.register_forward_pre_hook(lambda m, args: captured.update(streams=args[0]))
        with torch.no_grad():
            target(torch.tensor([ids]))
            handle.remove()
            next_ids = torch.tensor([ids[1:]])
            positions = torch.arange(len(ids) - 1)[None]
            embedded = self.e_proj(self.enorm(target.model.embed_tokens(next_ids)))  # [1, T-1, D]
            x = embedded.unsqueeze(2) + self.h_proj(self.hnorm(captured["streams"][:, :-1]))  # [1, T-1, N, D]
            mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=embedded, attention_mask=None,
                                                     cache=None, position_ids=positions)
            tables = {kind: self.rotary(embedded, position_ids=positions, layer_type=kind)
                      for kind in ("main", "compress")}
            x = self.block(x, input_ids=next_ids, position_embeddings=tables, position_ids=positions,
                           attention_mask=mask, cache=None)
            return target.lm_head(self.norm(self.hc_head(x)))[0]
