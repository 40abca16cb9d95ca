"""Model FLOPs of one DSA prefill, counted from the model config; the machine's fp32 GEMM rate; their ratio.

`prefill_flops` counts what the served prefill (model_workers/cp_prefill.py `run_prefill`) computes for a
prompt of L tokens: the target layers, then MTP layer 0 over the same rows when the checkpoint has MTP layers,
and the LM head (target and MTP) only on the rows whose logits are taken (each prefill chunk's last row). A
multiply-add is 2 FLOPs; norms, RoPE, softmax, routing and top-k selection are not counted. `flop_efficiency`
divides them by what the ranks' threads could do at the rate of a large fp32 matmul (`gemm_rates`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from model_workers.model.config import ModelConfig

PHASES = ("indexer", "attention", "mlp")  # the phase_clock phases the efficiency is given for
GEMM_SIZE, GEMM_REPEATS = 2048, 3

DEFINITIONS = {
    "model_flops": "FLOPs of one prefill of prompt_len tokens from the model config (2 per multiply-add): every "
                   "linear per token (attention: q_a, q_b, kv_a, W_UK on q_nope, W_UV on the attention output, o_proj;"
                   " indexer: wq_b, wk, weights_proj; mlp: the dense MLP, or the MoE's gate + shared experts + "
                   "num_experts_per_tok routed experts) over num_hidden_layers target layers plus MTP layer 0 (with "
                   "its eh_proj) when the checkpoint has MTP layers, as the served prefill runs it; the LM head "
                   "(target and MTP) on one row per prefill chunk; indexer scoring = causal query-key pairs "
                   "L(L+1)/2 x index_n_heads x index_head_dim x 2 per indexed layer; sparse attention = per query "
                   "min(index_topk, position + 1) keys x num_attention_heads x ((kv_lora_rank + qk_rope_head_dim) "
                   "+ kv_lora_rank) x 2 per layer",
    "phase_flops": "indexer = indexer linears + indexer scoring; attention = attention linears + sparse attention; "
                   "mlp = MLP / MoE linears (the phases of model_workers/phase_clock.py)",
    "gemm_flops_per_s": f"best of {GEMM_REPEATS} fp32 {GEMM_SIZE}x{GEMM_SIZE}x{GEMM_SIZE} torch.mm in the bench "
                        "process (2 * n^3 / seconds): `rank` with the threads one rank uses, `all` with the threads "
                        "of all ranks together (cp_size x threads_per_rank)",
    "efficiency": "model_flops / (prefill wall_s x gemm_flops_per_s all)",
    "phase_efficiency": "phase_flops / (that phase's seconds summed over the ranks x gemm_flops_per_s rank)",
}


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
    """Model FLOPs of one prefill of `length` tokens, by part and by phase (see DEFINITIONS["model_flops"])."""
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


def checkpoint_flop_config(model_dir) -> tuple[object, bool | None]:
    """(the config as the loader builds the model: num_nextn_predict_layers = the MTP layers the checkpoint
    holds, whether MTP layer 0 has an MoE (None: no MTP layer)); other config types are returned as they are."""
    import dataclasses

    from model_workers.checkpoint.loader import checkpoint_files, count_mtp_layers, mtp_layout
    from model_workers.model.config import load_model_config

    config = load_model_config(model_dir)
    if not isinstance(config, ModelConfig):
        return config, None
    names = set(checkpoint_files(Path(model_dir)))
    count = count_mtp_layers(config, names)
    layout = mtp_layout(config, names, count)
    return dataclasses.replace(config, num_nextn_predict_layers=count), layout[0][0] if layout else None


def gemm_flops_per_s(threads: int, size: int = GEMM_SIZE, repeats: int = GEMM_REPEATS) -> float:
    """fp32 matmul rate of this process with `threads` torch threads (best of `repeats`, after a warm-up);
    the thread count is restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best


def gemm_rates(cp_size: int, threads_per_rank: int) -> dict:
    """The rate of one rank's threads and of all the ranks' threads together (measured, not multiplied)."""
    total = cp_size * threads_per_rank
    rank = gemm_flops_per_s(threads_per_rank)
    return {"size": GEMM_SIZE, "repeats": GEMM_REPEATS, "rank_threads": threads_per_rank, "rank": rank,
            "all_threads": total, "all": rank if total == threads_per_rank else gemm_flops_per_s(total)}


def flop_efficiency(config, length: int, run: dict, gemm: dict, mtp_sparse: bool | None = None) -> dict:
    """The `prefill_flop_efficiency` block of one prefill `run` (a prefill_runs summary: wall_s, chunks,
    per_rank_phase_s) of `length` tokens, against `gemm_rates`; skipped for configs it cannot count.
    `config` and `mtp_sparse` as `checkpoint_flop_config` gives them."""
    if not isinstance(config, ModelConfig):
        return {"skipped": True, "reason": f"the FLOP count covers MLA + indexer models (deepseek_v32, glm_moe_dsa),"
                                           f" not {getattr(config, 'model_type', type(config).__name__)}"}
    flops = prefill_flops(config, length, logit_rows=run["chunks"], mtp_sparse=mtp_sparse)
    phase_s = {p: sum(split.get(p, 0.0) for split in run["per_rank_phase_s"]) for p in PHASES}
    return {
        "skipped": False, "prompt_len": length, "cp_size": len(run["per_rank_phase_s"]),
        "threads_per_rank": gemm["rank_threads"], "wall_s": run["wall_s"], "chunks": run["chunks"],
        "model_flops": flops, "gemm_flops_per_s": gemm, "phase_s_summed_over_ranks": phase_s,
        "efficiency": flops["total"] / (run["wall_s"] * gemm["all"]),
        "phase_efficiency": {p: flops["phases"][p] / (phase_s[p] * gemm["rank"]) if phase_s[p] > 0 else None
                             for p in PHASES},
    }
