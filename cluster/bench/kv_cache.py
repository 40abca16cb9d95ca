"""`dsa-serve bench kv-cache`: what the FP8 KV cache costs in accuracy and gains in capacity, against bf16.

Held-out prompts (windows of the source files the default model never trained on) are decoded greedily with
the bf16 cache; the FP8 cache then decodes the same sequences teacher-forced, step by step, so every position
compares the two caches on the same context. Reported: top-1 agreement (the FP8 argmax is bf16's greedy
token), mean and max |Δ logprob| of that token, and per dtype the KV bytes per token measured on the allocated
cache next to the formula, with the token capacity of the same cache memory.
"""

from __future__ import annotations

import argparse
import json
import time

from cluster.bench.common import cut_windows, held_out_stream, model_fingerprint, spelled_command
from cluster.commands.result_output import print_result

KV_CACHE_FLAGS = ("model", "prompts", "prompt_len", "max_tokens", "dtype")
COMPARED = ("bfloat16", "fp8_e4m3")  # reference first


def add_parser(kinds) -> None:
    bench = kinds.add_parser("kv-cache", help="FP8 vs bf16 KV cache: greedy top-1 agreement, |Δ logprob|, bytes")
    bench.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: the embedded one)")
    bench.add_argument("--prompts", type=int, default=8, help="held-out prompts, decoded as one batch")
    bench.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    bench.add_argument("--max-tokens", type=int, default=256, help="greedy positions compared per prompt")
    bench.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                       help="weights as stored (bf16 computes in float32 on CPUs without bf16)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=run_kv_cache)


def held_out_prompts(model_dir, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread over the held-out source files."""
    return cut_windows(held_out_stream(model_dir, "bench kv-cache"), count, length, "--prompts / --prompt-len")


def decode_run(model, kv_cache_dtype: str, storage, prompts: list[list[int]], steps: int, forced=None) -> dict:
    """Prefill the prompts, then `steps` decode steps of the whole batch: greedy, or feeding `forced` [B][steps]
    tokens. Per step and prompt: the argmax and the logprobs of the fed token; and the cache's bytes per token."""
    import torch

    from model_workers.runner import ExtendItem, ModelRunner

    runner = ModelRunner(model, num_pages=len(prompts) * (-(-(len(prompts[0]) + steps) // 64)), page_size=64,
                         kv_dtype=storage, kv_cache_dtype=kv_cache_dtype)
    tables = runner.standalone_tables([len(p) + steps for p in prompts])
    hidden = runner.extend([ExtendItem(t, p) for t, p in zip(tables, prompts)])  # [sum L, D]
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    logprobs = model.logits(hidden[last]).float().log_softmax(-1)  # [B, vocab]
    argmax, chosen, fed = [], [], []
    for step in range(steps):
        tokens = logprobs.argmax(-1) if forced is None else forced[:, step]  # [B]
        argmax.append(logprobs.argmax(-1))
        chosen.append(logprobs.gather(1, tokens[:, None])[:, 0])
        fed.append(tokens)
        hidden = runner.extend([ExtendItem(t, [int(tok)]) for t, tok in zip(tables, tokens)])  # [B, D]
        logprobs = model.logits(hidden).float().log_softmax(-1)
    return {"tokens": torch.stack(fed, 1), "argmax": torch.stack(argmax, 1), "logprobs": torch.stack(chosen, 1),
            "kv_bytes_per_token": runner.cache.bytes_per_token()}


def compare(reference: dict, fp8: dict) -> dict:
    agree = (fp8["argmax"] == reference["tokens"]).float()
    delta = (fp8["logprobs"] - reference["logprobs"]).abs()
    return {"positions": int(agree.numel()), "top1_agreement": round(float(agree.mean()), 5),
            "mean_abs_delta_logprob": round(float(delta.mean()), 6),
            "max_abs_delta_logprob": round(float(delta.max()), 5),
            "p99_abs_delta_logprob": round(float(delta.flatten().quantile(0.99)), 5)}


def run_kv_cache(args: argparse.Namespace) -> int:
    import torch

    from model_workers.checkpoint.loader import load_model
    from model_workers.checkpoint.model_dir import read_model_spec
    from model_workers.precision import compute_dtype, storage_dtype

    spec = read_model_spec(args.model)  # config.json read once
    model_dir, storage = spec.path, storage_dtype(args.dtype)
    model = load_model(spec, compute_dtype(storage, "cpu"), progress=False)
    prompts = held_out_prompts(model_dir, args.prompts, args.prompt_len)
    start = time.perf_counter()
    with torch.inference_mode():
        reference = decode_run(model, "bfloat16", storage, prompts, args.max_tokens)
        fp8 = decode_run(model, "fp8_e4m3", storage, prompts, args.max_tokens, forced=reference["tokens"])
    runs = {"bfloat16": reference, "fp8_e4m3": fp8}
    by_dtype = {name: {"measured_kv_bytes_per_token": runs[name]["kv_bytes_per_token"],
                       "formula_kv_bytes_per_token": spec.family.cache_bytes_per_token(model.config, name),
                       "tokens_per_gib": (2**30) // runs[name]["kv_bytes_per_token"]} for name in COMPARED}
    result = {
        "bench": "kv-cache", "command": spelled_command("kv-cache", args, KV_CACHE_FLAGS),
        "model": model_dir.name, "model_fingerprint": model_fingerprint(model_dir),
        "dtype": args.dtype, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "greedy_reference": "bfloat16 KV cache; FP8 teacher-forced on its tokens",
        **compare(reference, fp8),
        "kv": by_dtype,
        "fp8_capacity_gain": round(by_dtype["bfloat16"]["measured_kv_bytes_per_token"]
                                   / by_dtype["fp8_e4m3"]["measured_kv_bytes_per_token"], 4),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print_result(json.dumps(result, indent=None if args.json else 2))
    return 0
