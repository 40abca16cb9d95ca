"""`dsa-serve bench prefill`: CP prefill scaling over prompt lengths, through the engine `serve` runs.

Per length L, three CP groups prefill the same random prompt (one output token): C = 1 with 1 thread, C = 1
with C threads (the same cores as the CP run) and C ranks with 1 thread each. Each group is driven by the
engine twice: the served path (the prompt chunked into prefill batches of serve's default, 2048 tokens per CP rank,
as `serve` runs it; the headline numbers) and one unchunked batch (`one_batch`). The groups run at the same time
and take turns, prefill by prefill, so that a machine whose speed drifts weighs on every group alike (one group
after another, the C = 1 and the CP runs of one length were minutes apart). Reported: strong-scaling efficiency
T(C=1, 1 thread) / (C · T(C)), equal-cores ratio T(C=1, C threads) / T(C), per-rank compute and its imbalance
(measured, and the causal-work model for zigzag / interleave / a contiguous split), the time split per phase,
KV gather bytes next to the formula, peak RSS per rank and KV bytes per token. The groups are Ray actors; at C = 1
(no --ray-address) there is one group, a worker in this process that is both runs, and the bench imports no Ray.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from cluster.bench.common import model_fingerprint, spelled_command
from cluster.commands.args import (
    add_cp_arguments,
    add_attention_backend_argument,
    add_deterministic_argument,
    add_dtype_argument,
    add_kv_cache_dtype_argument,
    int_list,
)
from cluster.commands.result_output import print_result
from cp_router.cp.balance import causal_work_per_rank, contiguous_causal_work, max_over_mean
from cp_router.cp.strategies import CP_STRATEGIES

DEFAULT_LENGTHS = "1024,2048,4096,8192,16384,32768"
PREFILL_FLAGS = ("model", "cp_size", "cp_strategy", "cp_impl", "ep_size", "prompt_len", "dtype", "kv_cache_dtype",
                 "repeats", "skip_equal_cores", "enable_deterministic_inference")
PATHS = {"served": "the prompt in chunks of serve's default, one engine step each (what serve runs): 2048 tokens "
                   "per CP rank, so prefill_chunk_tokens (the CP group's) at C ranks and 2048 at C = 1",
         "one_batch": "the whole prompt as one prefill batch (one engine step)"}


def add_parser(kinds) -> None:
    prefill = kinds.add_parser("prefill", help="CP prefill scaling: C ranks against C = 1 over prompt lengths")
    prefill.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    add_cp_arguments(prefill, required=True)
    prefill.add_argument("--prompt-len", default=DEFAULT_LENGTHS, help="tokens per prompt, or a comma list")
    add_dtype_argument(prefill, default="bfloat16", allow_auto=False)
    add_kv_cache_dtype_argument(prefill)
    add_deterministic_argument(prefill)
    add_attention_backend_argument(prefill)
    prefill.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, or cuda[:N]")
    prefill.add_argument("--repeats", type=int, default=1, help="timed prefills per length (median kept)")
    prefill.add_argument("--skip-equal-cores", action="store_true", help="no C=1 run with C threads")
    prefill.add_argument("--json", action="store_true", help="print one JSON object")
    prefill.add_argument("--plot", default=None, help="also draw the results into this PNG")
    prefill.set_defaults(run=run_prefill)


def formula_kv_bytes(model, cp_size: int, num_tokens: int, dtype: str, kv_cache_dtype: str = "auto") -> float:
    """KV bytes one rank receives in CP prefill (the per-layer gathers), by its family's formula."""
    per_token = model.family.gather_bytes_per_token(model.config, kv_dtype_name(dtype, kv_cache_dtype))
    return (cp_size - 1) / cp_size * num_tokens * per_token


def kv_bytes_per_token_formula(model, dtype: str, kv_cache_dtype: str = "auto") -> float:
    """Cache bytes one more token of context costs on its owner, by its family's formula."""
    return model.family.cache_bytes_per_token(model.config, kv_dtype_name(dtype, kv_cache_dtype))


def kv_dtype_name(dtype: str, kv_cache_dtype: str) -> str:
    """What the cache stores: --kv-cache-dtype, `auto` being --dtype."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def modeled_imbalance(length: int, cp_size: int, impl: str) -> dict[str, float]:
    """max / mean causal work per rank for each layout (the indexer's share of prefill cost)."""
    from cp_router.cp import build_cp_metadata, can_split

    out = {"contiguous": max_over_mean(contiguous_causal_work(length, cp_size))}
    for strategy in CP_STRATEGIES:
        if can_split([length], cp_size, strategy):
            out[strategy] = max_over_mean(causal_work_per_rank(build_cp_metadata([length], [0], cp_size, strategy, impl)))
    return out


def path_entry(cp_size: int, single: dict, equal: dict | None, ranks: dict) -> dict:
    """One path at one length: the three runs and the ratios derived from them."""
    t1, t_cp = single["wall_s"], ranks["wall_s"]
    return {
        "c1_wall_s": t1, "cp_wall_s": t_cp, "c1_cthreads_wall_s": equal["wall_s"] if equal else None,
        "chunks": ranks["chunks"], "strong_scaling_efficiency": t1 / (cp_size * t_cp),
        "equal_cores_ratio": equal["wall_s"] / t_cp if equal else None,
        "per_rank_compute_s": ranks["per_rank_compute_s"],
        "compute_imbalance_max_over_mean": ranks["compute_imbalance_max_over_mean"],
        "per_rank_phase_s": ranks["per_rank_phase_s"], "c1_phase_s": single["per_rank_phase_s"][0],
        "measured_kv_bytes_per_rank": max(ranks["kv_comm_bytes_per_rank"]),
        "comm_bytes_per_rank": ranks["comm_bytes_per_rank"],
        "peak_rss_bytes_per_rank": ranks["peak_rss_bytes_per_rank"],
        "c1_peak_rss_bytes": single["peak_rss_bytes_per_rank"][0],
        "runs": [dict(single, cp_size=1, threads_per_rank=1)]
        + ([dict(equal, cp_size=1, threads_per_rank=cp_size)] if equal else [])
        + [dict(ranks, cp_size=cp_size, threads_per_rank=1)],
    }


def length_entry(length: int, cp, model, args, configs: list[dict | None], flop_setup: tuple) -> dict:
    """One prompt length: the served path's numbers at the top (with the C ranks' FLOP efficiency, `flop_setup`
    = (checkpoint_flop_config, gemm_rates)), the unchunked batch under `one_batch`."""
    from cluster.bench.flops import flop_efficiency

    single, equal, ranks = configs

    def runs(path: str) -> tuple:
        return single["paths"][path][length], equal["paths"][path][length] if equal else None, ranks["paths"][path][length]

    entry = {"prompt_len": length, "cp_size": cp.cp_size, **path_entry(cp.cp_size, *runs("served"))}
    entry["modeled_causal_work_imbalance"] = modeled_imbalance(length, cp.cp_size, cp.impl)
    entry["formula_kv_bytes_per_rank"] = formula_kv_bytes(model, cp.cp_size, length, args.dtype,
                                                          args.kv_cache_dtype)
    entry["one_batch"] = path_entry(cp.cp_size, *runs("one_batch"))
    (config, mtp_sparse), gemm = flop_setup
    entry["prefill_flop_efficiency"] = flop_efficiency(config, length, runs("served")[2], gemm, mtp_sparse)
    return entry


def run_prefill(args: argparse.Namespace) -> int:
    from cluster.bench.flops import DEFINITIONS as FLOP_DEFINITIONS
    from cluster.bench.flops import checkpoint_flop_config, gemm_rates
    from cluster.config import resolve_cp_settings
    from model_workers.checkpoint.model_dir import read_model_spec

    lengths = sorted(set(int_list(args.prompt_len, "--prompt-len", 1, 1 << 20)))
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.plot:
        from cluster.bench.render import require_matplotlib
        require_matplotlib()
    model = read_model_spec(args.model)  # config.json read once
    model_dir: Path = model.path
    cp = resolve_cp_settings(args, model)
    generator = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths}
    with_equal = not args.skip_equal_cores and cp.cp_size > 1
    timed = time_configs(model_dir, cp, with_equal, prompts, args)
    single, equal, ranks = timed[0], (timed[1] if with_equal else None), timed[-1]
    flop_setup = checkpoint_flop_config(model), gemm_rates(cp.cp_size, 1)  # Ray is down: nothing else runs
    result = {
        "bench": "prefill", "command": spelled_command("prefill", args, PREFILL_FLAGS),
        "model": str(model_dir), "model_fingerprint": model_fingerprint(model_dir),
        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "device": args.device,
        "deterministic": args.enable_deterministic_inference,
        "cpu_count": os.cpu_count(),
        "cp_size": cp.cp_size, "cp_strategy": cp.strategy, "cp_impl": cp.impl, "ep_size": cp.ep_size,
        "repeats": args.repeats,
        "prefill_chunk_tokens": ranks["prefill_chunk_tokens"], "paths": PATHS,
        **model.family.kv_formulas(args.kv_cache_dtype),
        "measured_kv_bytes_per_token": ranks["kv_bytes_per_token"],
        "formula_kv_bytes_per_token": kv_bytes_per_token_formula(model, args.dtype, args.kv_cache_dtype),
        **kv_capacity(model),
        "lengths": [length_entry(n, cp, model, args, [single, equal, ranks], flop_setup) for n in lengths],
        "definitions": {"prefill_flop_efficiency": FLOP_DEFINITIONS},
    }
    emit(result, args)
    return 0


def time_configs(model_dir: Path, cp, with_equal: bool, prompts: dict[int, list[int]], args) -> list[dict]:
    """`run_configs` of C = 1 with 1 thread, C = 1 with C threads (`with_equal`) and the C ranks, all groups at once
    on a Ray this command starts or joins. At C = 1 without --ray-address the one C = 1 group is both runs, a worker
    in this process, and this module imports no Ray."""
    from cluster.bench.prefill_runs import run_configs
    from cluster.config import ResolvedCPConfig

    if cp.cp_size == 1 and not args.ray_address:
        return run_configs(model_dir, [(cp, 1)], prompts, args, args.repeats, in_process=True)
    from cluster.launch import engine_cpus, ray_session

    single_cp = ResolvedCPConfig(enabled=False, cp_size=1, strategy=cp.strategy, impl=cp.impl)
    configs = [(single_cp, 1)] + ([(single_cp, cp.cp_size)] if with_equal else []) + [(cp, 1)]
    with ray_session(sum(engine_cpus(c.cp_size) for c, _ in configs), args.ray_address):
        return run_configs(model_dir, configs, prompts, args, args.repeats)


def kv_capacity(model) -> dict:
    """Both KV formats side by side where the family's plan has them (MLA models): bytes per token, tokens per GiB
    of cache, FP8's capacity gain."""
    from model_workers.checkpoint.capacity import kv_tokens_that_fit

    plan = model.family.kv_plan(model.config, "bfloat16", 0, None, kv_tokens_that_fit)
    return {"kv_by_dtype": plan["kv_by_dtype"]} if "kv_by_dtype" in plan else {}


def emit(result: dict, args: argparse.Namespace) -> None:
    if args.plot:
        from cluster.bench.plot import save_plot
        save_plot(result, args.plot)
    if args.json:
        print_result(json.dumps(result))
        return
    for e in result["lengths"]:
        one = e["one_batch"]
        print_result(
            f"L={e['prompt_len']}: C=1 {e['c1_wall_s']:.2f}s, C={e['cp_size']} {e['cp_wall_s']:.2f}s in {e['chunks']}"
            f" chunk(s), strong-scaling efficiency {e['strong_scaling_efficiency']:.3f} (one batch: C=1"
            f" {one['c1_wall_s']:.2f}s, C={e['cp_size']} {one['cp_wall_s']:.2f}s, {one['strong_scaling_efficiency']:.3f}),"
            f" KV bytes/rank {e['measured_kv_bytes_per_rank']} (formula {e['formula_kv_bytes_per_rank']:.0f}),"
            f" peak RSS/rank {max(e['peak_rss_bytes_per_rank']) / 2**30:.2f} GiB"
            f"{efficiency_text(e['prefill_flop_efficiency'])}")


def efficiency_text(block: dict) -> str:
    """`, FLOP efficiency x (indexer a, attention b, mlp c)`, or nothing when the count was skipped."""
    if block.get("skipped"):
        return ""
    phases = ", ".join(f"{p} {v:.3f}" for p, v in block["phase_efficiency"].items() if v is not None)
    return f", FLOP efficiency {block['efficiency']:.3f} ({phases})"
