"""Model FLOPs of one DSA prefill, counted from the config (the family's `prefill_flops`, for the benchmarks'
FLOP efficiency: cluster/bench/flops.py).

`prefill_flops` counts what the served prefill (model_workers/cp_prefill.py `run_prefill`) computes for a
prompt of L tokens: the target layers, then MTP layer 0 over the same rows when the checkpoint has MTP layers,
and the LM head (target and MTP) only on the rows whose logits are taken (each prefill chunk's last row). A
multiply-add is 2 FLOPs; norms, RoPE, softmax, routing and top-k selection are not counted.
"""

from __future__ import annotations

from model_workers.models.dsa.config import ModelConfig


def causal_pairs(length: int) -> int:
    """Query-key pairs of a causal prompt of `length` tokens: L(L+1)/2."""
    return length * (length + 1) // 2


def sparse_keys(length: int, topk: int) -> int:
    """Σ over positions p < L of min(topk, p + 1): the keys sparse attention reads for the whole prompt."""
    ramp = min(length, topk)
    return causal_pairs(ramp) + (length - ramp) * topk


def layer_linear_flops(config: ModelConfig, has_indexer: bool, sparse_mlp: bool) -> dict[str, int]:
    """FLOPs per token of one layer's linears, by phase."""
    c, hidden, heads = config, config.hidden_size, config.num_attention_heads
    attention = (hidden * c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim + hidden * c.latent_dim
                 + heads * c.qk_nope_head_dim * c.kv_lora_rank + heads * c.kv_lora_rank * c.v_head_dim
                 + heads * c.v_head_dim * hidden)
    indexer = (c.q_lora_rank * c.index_n_heads * c.index_head_dim + hidden * c.index_head_dim
               + hidden * c.index_n_heads) if has_indexer else 0
    if sparse_mlp:
        expert = 3 * hidden * c.moe_intermediate_size
        mlp = hidden * c.n_routed_experts + c.n_shared_experts * expert + c.num_experts_per_tok * expert
    else:
        mlp = 3 * hidden * c.intermediate_size
    return {"attention": 2 * attention, "indexer": 2 * indexer, "mlp": 2 * mlp}


def prefill_layers(config: ModelConfig, mtp_sparse: bool | None = None) -> list[tuple[bool, bool]]:
    """(has an indexer, MoE MLP) per layer the prefill runs: the target layers, then MTP layer 0 if the config
    has MTP layers (always indexed; MoE unless `mtp_sparse` says otherwise, or the model has no experts)."""
    layers = [(kind == "full", mlp == "sparse") for kind, mlp in zip(config.indexer_types, config.mlp_layer_types)]
    if config.num_nextn_predict_layers > 0:
        layers.append((True, config.n_routed_experts > 0 if mtp_sparse is None else mtp_sparse))
    return layers


def prefill_flops(config: ModelConfig, length: int, logit_rows: int = 1, mtp_sparse: bool | None = None) -> dict:
    """Model FLOPs of one prefill of `length` tokens, by part and by phase (the benchmarks' DEFINITIONS["model_flops"]
    in cluster/bench/flops.py say what each part counts)."""
    layers = prefill_layers(config, mtp_sparse)
    linears = [layer_linear_flops(config, indexed, sparse) for indexed, sparse in layers]
    has_mtp = config.num_nextn_predict_layers > 0
    heads_out = 2 * config.hidden_size * config.vocab_size
    parts = {
        "attention_linears": length * sum(f["attention"] for f in linears),
        "sparse_attention": len(layers) * sparse_keys(length, config.index_topk) * config.num_attention_heads
        * (config.latent_dim + config.kv_lora_rank) * 2,
        "indexer_linears": length * sum(f["indexer"] for f in linears),
        "indexer_scoring": sum(indexed for indexed, _ in layers) * causal_pairs(length) * config.index_n_heads
        * config.index_head_dim * 2,
        "mlp_linears": length * sum(f["mlp"] for f in linears),
        "mtp_eh_proj": length * 2 * (2 * config.hidden_size) * config.hidden_size if has_mtp else 0,
        "lm_head": logit_rows * heads_out * (2 if has_mtp else 1),
    }
    phases = {"indexer": parts["indexer_linears"] + parts["indexer_scoring"],
              "attention": parts["attention_linears"] + parts["sparse_attention"], "mlp": parts["mlp_linears"]}
    return {"prompt_len": length, "layers": len(layers), "logit_rows": logit_rows, "parts": parts, "phases": phases,
            "total": sum(parts.values())}
