"""`dsa-serve plan`: per-rank weight bytes, KV bytes per token and the KV tokens that fit, from config.json alone.

Nothing is loaded or launched: the model is built on the meta device and its checkpoint tensors counted.
"""

from __future__ import annotations

import argparse
import json
from typing import get_args

from cluster.config import KVCacheDTypeName


def add_parser(commands) -> None:
    parser = commands.add_parser("plan", help="capacity plan: weight bytes and KV tokens per rank (reads config.json)")
    parser.add_argument("--model", required=True, help="checkpoint folder; only its config.json is read")
    parser.add_argument("--cp-size", type=int, required=True, help="ranks in the CP group (C)")
    parser.add_argument("--ep-size", type=int, required=True,
                        help="expert-parallel size: 1 (experts replicated) or the CP size (experts sharded)")
    parser.add_argument("--kv-cache-dtype", choices=get_args(KVCacheDTypeName), default="auto",
                        help="KV cache format: auto (= bfloat16), bfloat16, fp8_e4m3 (docs/kv_cache.md's FP8 layout); both"
                             " bfloat16 and fp8_e4m3 are reported side by side")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory of one device in GiB (141 for an H200): adds kv_tokens_that_fit")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from model_workers.checkpoint.capacity import plan

    result = plan(args.model, args.cp_size, args.ep_size, args.kv_cache_dtype, args.device_memory_gib)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def _gb(num_bytes: int) -> str:
    return f"{num_bytes:>19,} B {num_bytes / 1e9:>10,.2f} GB"


def format_plan(result: dict) -> str:
    """A short human table: one rank's bytes by class (every rank holds the same amount under EP in {1, C}), then
    the KV line the model's family writes."""
    from model_workers.models.registry import family_for

    inputs, ckpt, params, rank = result["inputs"], result["checkpoint"], result["params"], result["ranks"][0]
    fp8 = f", FP8 blocks {ckpt['fp8_block_size']}" if ckpt["fp8_block_size"] else ""
    lines = [
        (f"{result['model_type']} ({ckpt['dtype']}{fp8}): {ckpt['num_hidden_layers']} layers + "
         f"{ckpt['num_mtp_layers']} MTP, {ckpt['n_routed_experts']} routed experts"),
        (f"params: {params['total']:,} ({params['total'] / 1e9:.2f} B), routed experts {params['routed_experts']:,}, "
         f"MTP layers {params['mtp_layers']:,}; checkpoint {result['total_checkpoint_bytes'] / 1e9:,.2f} GB"),
        f"cp_size {inputs['cp_size']}, ep_size {inputs['ep_size']}: {ckpt['experts_per_rank']} experts per rank",
        "",
        f"{'class':<16}{'bytes per rank':>35}",
    ]
    lines += [f"{name:<16}{_gb(rank['bytes_by_class'][name]):>35}" for name in rank["bytes_by_class"]]
    lines += [
        f"{'replicated':<16}{_gb(rank['replicated_bytes']):>35}",
        f"{'routed (owned)':<16}{_gb(rank['routed_bytes']):>35}",
        (f"{'weights':<16}{_gb(result['max_rank_weight_bytes']):>35}  "
         f"({result['max_rank_weight_bytes'] / 2**30:,.2f} GiB)"),
        "",
    ]
    lines.append(family_for(result["model_type"]).kv_summary(result))
    if "kv_by_dtype" in result:
        lines.append(kv_comparison_line(result["kv_by_dtype"]))
    if "kv_tokens_that_fit" in result:
        verdict = (f"{result['kv_tokens_that_fit']:,} KV tokens fit per rank" if result["weights_fit"]
                   else "the weights alone do not fit")
        lines.append(f"device {inputs['device_memory_gib']:g} GiB: {verdict} (before activations and workspace)")
    return "\n".join(lines)


def kv_comparison_line(by_dtype: dict) -> str:
    """bfloat16 vs fp8_e4m3: bytes per token (and tokens that fit) per rank, and the FP8 capacity gain."""
    parts = []
    for name in ("bfloat16", "fp8_e4m3"):
        fit = f", {by_dtype[name]['kv_tokens_that_fit']:,} tokens fit" if "kv_tokens_that_fit" in by_dtype[name] else ""
        parts.append(f"{name} {by_dtype[name]['kv_bytes_per_token']:,} B/token{fit}")
    return f"KV by dtype: {'; '.join(parts)}; FP8 holds {by_dtype['fp8_capacity_gain']:.2f}x the tokens"
