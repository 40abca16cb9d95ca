"""Model FLOPs of one prefill (a family's `prefill_flops`: model_workers/models/dsa/flops.py); the machine's fp32
GEMM rate; their ratio.

`flop_efficiency` divides the FLOPs of what the served prefill computes (model_workers/cp_prefill.py
`run_prefill`) by what the ranks' threads could do at the rate of a large fp32 matmul (`gemm_rates`); DEFINITIONS
says what is counted.
"""

from __future__ import annotations

import time

import torch

from model_workers.models.registry import BY_MODEL_TYPE, FAMILIES

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


def checkpoint_flop_config(model) -> tuple[object, bool | None]:
    """(the config as the loader builds the model: num_nextn_predict_layers = the MTP layers the checkpoint
    holds, whether MTP layer 0 has an MoE (None: no MTP layer)); `model` a folder or a `ModelSpec`. A family
    without a FLOP count gets its config back as it is."""
    from model_workers.checkpoint.loader import checkpoint_files
    from model_workers.checkpoint.model_dir import as_model_spec

    spec = as_model_spec(model)
    if spec.family.prefill_flops is None:
        return spec.config, None
    with torch.device("meta"):  # the model the loader would build: no memory, no weights read
        built, config = spec.family.build_model(spec.config, set(checkpoint_files(spec.path)), None)
    layers = built.model.layers[config.num_hidden_layers :]
    return config, (getattr(layers[0].mlp, "experts", None) is not None) if len(layers) else None


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
    family = BY_MODEL_TYPE.get(getattr(config, "model_type", None))
    if family is None or family.prefill_flops is None:
        counted = ", ".join(t for f in FAMILIES if f.prefill_flops is not None for t in f.model_types)
        return {"skipped": True, "reason": f"the FLOP count covers MLA + indexer models ({counted}),"
                                           f" not {getattr(config, 'model_type', type(config).__name__)}"}
    flops = family.prefill_flops(config, length, logit_rows=run["chunks"], mtp_sparse=mtp_sparse)
    phase_s = {p: sum(split.get(p, 0.0) for split in run["per_rank_phase_s"]) for p in PHASES}
    return {
        "skipped": False, "prompt_len": length, "cp_size": len(run["per_rank_phase_s"]),
        "threads_per_rank": gemm["rank_threads"], "wall_s": run["wall_s"], "chunks": run["chunks"],
        "model_flops": flops, "gemm_flops_per_s": gemm, "phase_s_summed_over_ranks": phase_s,
        "efficiency": flops["total"] / (run["wall_s"] * gemm["all"]),
        "phase_efficiency": {p: flops["phases"][p] / (phase_s[p] * gemm["rank"]) if phase_s[p] > 0 else None
                             for p in PHASES},
    }
