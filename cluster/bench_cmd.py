"""`dsa-serve bench prefill`: CP prefill at cp_size C next to the same run at C = 1, in one Ray session.

Prints wall time (router-side, one prefill step), per-rank compute time (step minus collectives), bytes
received by the per-layer KV gathers (measured by the comm) next to the formula
(C-1)/C * L * layers * (kv_lora_rank + rope + index_head_dim) * bytes, and the C=1 / C wall-time ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from . import bench_decode
from .cp_args import add_cp_arguments

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FORMULA = "(C-1)/C * L * layers * (kv_lora_rank + qk_rope_head_dim + index_head_dim) * dtype_bytes"


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    prefill = kinds.add_parser("prefill", help="CP prefill against C=1: wall time, compute per rank, comm bytes")
    prefill.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    add_cp_arguments(prefill, required=True)
    prefill.add_argument("--prompt-len", type=int, required=True, help="tokens per prompt (L)")
    prefill.add_argument("--batch-size", type=int, default=1, help="prompts per prefill batch")
    prefill.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    prefill.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    prefill.add_argument("--repeats", type=int, default=3, help="timed prefills per configuration (median kept)")
    prefill.add_argument("--warmup", type=int, default=1)
    prefill.add_argument("--json", action="store_true", help="print one JSON object")
    prefill.set_defaults(run=run_prefill)
    bench_decode.add_parser(kinds)


def formula_kv_bytes(hf_config: dict, cp_size: int, num_tokens: int, layers: int, dtype: str) -> float:
    per_token = hf_config["kv_lora_rank"] + hf_config["qk_rope_head_dim"] + hf_config["index_head_dim"]
    return (cp_size - 1) / cp_size * num_tokens * layers * per_token * DTYPE_BYTES[dtype]


def measure(engine, prompts: list[list[int]], cp, repeats: int, warmup: int) -> dict:
    """Median over `repeats` prefills (after `warmup`) of one batch through the router; pages freed each time."""
    import ray

    reports = []
    for i in range(warmup + repeats):
        report = ray.get(engine.router.prefill.remote(prompts, strategy=cp.strategy, impl=cp.impl))
        ray.get(engine.router.release.remote(report.request_ids))
        if i >= warmup:
            reports.append(report)
    ranks = [sorted(r.ranks, key=lambda x: x.cp_rank) for r in reports]  # [repeats][ranks]
    compute = [statistics.median(run[k].compute_s for run in ranks) for k in range(len(ranks[0]))]
    return {
        "cp_size": cp.cp_size,
        "cp_size_used": reports[0].cp_size_used,
        "wall_s": statistics.median(r.wall_s for r in reports),
        "per_rank_compute_s": compute,
        "per_rank_comm_s": [statistics.median(run[k].comm_s for run in ranks) for k in range(len(compute))],
        "per_rank_cpu_s": [statistics.median(run[k].cpu_s for run in ranks) for k in range(len(compute))],
        "compute_imbalance_max_over_mean": max(compute) / statistics.mean(compute),
        "per_rank_logical_token": list(reports[0].per_rank_logical_token),
        "kv_comm_bytes_per_rank": [x.kv_comm_bytes for x in ranks[0]],
        "comm_bytes_per_rank": [x.comm_bytes for x in ranks[0]],
        "collectives_per_rank": [x.num_collectives for x in ranks[0]],
    }


def run_prefill(args: argparse.Namespace) -> int:
    from cluster.config import ResolvedCPConfig
    from cluster.cp_args import resolve_cp_args
    from cluster.cp_cmd import engine_session, ray_session
    from cluster.launch import engine_cpus
    from cp_router.padding import ceil_div
    from model_workers.generation import resolve_model_dir

    for flag, value in [("--prompt-len", args.prompt_len), ("--batch-size", args.batch_size), ("--repeats", args.repeats)]:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    model_dir: Path = resolve_model_dir(args.model)
    cp = resolve_cp_args(args, model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf_config["vocab_size"], (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.batch_size)]
    num_pages = args.batch_size * (ceil_div(args.prompt_len, 64) + 1)
    baseline = ResolvedCPConfig(enabled=False, cp_size=1, strategy=cp.strategy, impl=cp.impl)
    runs = []
    with ray_session(engine_cpus(cp.cp_size), args.ray_address):
        for config in [baseline, cp] if cp.cp_size > 1 else [cp]:
            with engine_session(model_dir, config, args, num_pages) as engine:
                runs.append(measure(engine, prompts, config, args.repeats, args.warmup))
    layers = hf_config["num_hidden_layers"] + int(hf_config.get("num_nextn_predict_layers") or 0)
    num_tokens = args.prompt_len * args.batch_size
    formula = formula_kv_bytes(hf_config, cp.cp_size, num_tokens, layers, args.dtype)
    result = {
        "bench": "prefill", "model": str(model_dir), "dtype": args.dtype, "device": args.device,
        "prompt_len": args.prompt_len, "batch_size": args.batch_size, "cp_size": cp.cp_size,
        "cp_strategy": cp.strategy, "cp_impl": cp.impl, "layers_gathering_kv": layers,
        "formula": FORMULA, "formula_kv_bytes_per_rank": formula,
        "measured_kv_bytes_per_rank": max(runs[-1]["kv_comm_bytes_per_rank"]),
        "speedup_vs_cp1": runs[0]["wall_s"] / runs[-1]["wall_s"], "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prefill L={num_tokens} C={cp.cp_size}: {runs[-1]['wall_s']:.3f}s, x{result['speedup_vs_cp1']:.2f} vs C=1;"
              f" KV bytes/rank {result['measured_kv_bytes_per_rank']} (formula {formula:.0f})")
    return 0
