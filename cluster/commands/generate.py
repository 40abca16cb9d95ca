"""`dsa-serve generate`: complete prompts through the engine and print the results (text, or JSON lines).

Without --cp-size, or with --cp-size 1 (and no --ep-size > 1), the engine and its one rank run in this process,
without Ray (a Python where `import ray` fails runs it); with --cp-size C > 1, on a CP group of Ray actors.
--n-requests N runs N requests concurrently (cycling over the prompts, seed + i for request i).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cluster.commands.args import (
    add_cp_arguments,
    add_attention_backend_argument,
    add_cuda_graph_argument,
    add_prefix_cache_arguments,
    add_deterministic_argument,
    add_dtype_argument,
    add_kv_cache_dtype_argument,
    add_speculative_argument,
    prefix_caching_on,
)
from cluster.commands.result_output import print_result, with_results_only_on_stdout
from cluster.config import check_speculative_steps, resolve_cp_settings
from cp_router.cp.padding import ceil_div
from cp_router.protocol import EngineRequest
from model_workers.spec import ModelSpec

PAGE_SIZE = 64


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not returned")
    parser.add_argument("--stop-token-ids", default="", help="comma-separated extra stop token ids")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logprobs", type=int, default=None, help="return the chosen tokens' logprobs (+ N top)")
    add_speculative_argument(parser)


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="complete prompts with a local model")
    parser.add_argument("--model", default=None, help="checkpoint folder (config.json + *.safetensors)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeatable; needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    add_sampling_arguments(parser)
    parser.add_argument("--n-requests", type=int, default=1, help="requests run concurrently (one JSON line each)")
    add_dtype_argument(parser, default="auto")
    add_kv_cache_dtype_argument(parser)
    add_deterministic_argument(parser)
    add_attention_backend_argument(parser)
    add_cuda_graph_argument(parser)
    add_prefix_cache_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, or cuda[:N]")
    parser.add_argument("--json", action="store_true", help="print one JSON object per request")
    add_cp_arguments(parser)
    parser.set_defaults(run=with_results_only_on_stdout(run))


def parse_prompt_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from exc
    if not ids and flag == "--prompt-ids":
        raise ValueError("--prompt-ids is empty")
    return ids


def check_arguments(args: argparse.Namespace) -> None:
    """One-line errors naming the flag, before any model or Ray work."""
    checks = [
        ("--max-tokens", args.max_tokens >= 1, ">= 1"), ("--temperature", args.temperature >= 0, ">= 0"),
        ("--top-p", 0 < args.top_p <= 1, "in (0, 1]"), ("--top-k", args.top_k >= 0, ">= 0"),
        ("--min-tokens", 0 <= args.min_tokens <= args.max_tokens, "in [0, --max-tokens]"),
        ("--n-requests", args.n_requests >= 1, ">= 1"),
        ("--logprobs", args.logprobs is None or args.logprobs >= 0, ">= 0"),
    ]
    for flag, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{flag} must be {allowed}, got {getattr(args, flag[2:].replace('-', '_'))}")
    check_speculative_steps(args.speculative_num_steps, "--speculative-num-steps")


def read_prompts(args: argparse.Namespace, model_dir: Path, vocab_size: int) -> list[list[int]]:
    """--prompt texts (tokenized) or --prompt-ids lists, each checked against the vocabulary."""
    from model_workers.checkpoint.tokenizer import encode, load_tokenizer

    if args.prompt is not None:
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise ValueError(f"--prompt needs {model_dir / 'tokenizer.json'}; use --prompt-ids instead")
        prompts = [encode(tokenizer, text) for text in args.prompt]
    else:
        prompts = [parse_prompt_ids(text) for text in args.prompt_ids]
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if not ids:
            raise ValueError("--prompt encodes to no tokens")
    return prompts


def cli_requests(args: argparse.Namespace, prompts: list[list[int]]) -> list[EngineRequest]:
    stop_ids = tuple(parse_prompt_ids(args.stop_token_ids, "--stop-token-ids"))
    return [
        EngineRequest(
            f"cli-{i}", tuple(prompts[i % len(prompts)]), args.max_tokens, args.temperature, args.top_p, args.top_k,
            args.min_tokens, stop_ids, tuple(args.stop), args.ignore_eos, args.seed + i, args.logprobs,
        )
        for i in range(args.n_requests)
    ]


def run_generate(args: argparse.Namespace, model: ModelSpec) -> list[dict]:
    """Prompts -> results through the engine: in this process (C = 1), or CP prefill across Ray ranks."""
    from cluster.engine_setup import run_all, start_local_engine
    from cluster.engine_spec import EngineOptions, LOCAL_CP

    cp = resolve_cp_settings(args, model) if args.cp_size is not None else None
    requests = cli_requests(args, read_prompts(args, model.path, model.config.vocab_size))
    k = args.speculative_num_steps
    num_pages = sum(ceil_div(len(r.prompt_token_ids) + r.max_tokens + k + 1, PAGE_SIZE) for r in requests) + 1
    options = EngineOptions(args.dtype, num_pages, PAGE_SIZE, k, use_gpu=str(args.device).startswith("cuda"),
                            kv_cache_dtype=args.kv_cache_dtype, deterministic=args.enable_deterministic_inference,
                            speculative_token_map=args.speculative_token_map,
                            attention_backend=args.attention_backend, disable_cuda_graph=args.disable_cuda_graph,
                            enable_prefix_caching=prefix_caching_on(args))
    if cp is not None and cp.cp_size > 1:
        results = run_on_ray(args, model, cp, options, requests)
    else:
        results = run_all(start_local_engine(model, options, cp=cp or LOCAL_CP), requests)
    if cp is not None:
        for result in results:
            result.update(cp_size=cp.cp_size, cp_strategy=cp.strategy, cp_impl=cp.impl, ep_size=cp.ep_size)
    return results


def run_on_ray(args: argparse.Namespace, model: ModelSpec, cp, options, requests: list[EngineRequest]) -> list[dict]:
    """The requests on a CP group of Ray actors (started for this command, or on --ray-address's cluster)."""
    from cluster.engine_setup import run_all
    from cluster.launch import engine_cpus, ray_session
    from cluster.ray_engine import start_engine

    with ray_session(engine_cpus(cp.cp_size), args.ray_address):
        engine, group = start_engine(model, cp, options)
        try:
            return run_all(engine, requests)
        finally:
            group.shutdown()


def run(args: argparse.Namespace) -> int:
    from model_workers.checkpoint.model_dir import read_model_spec

    check_arguments(args)
    results = run_generate(args, read_model_spec(args.model))  # config.json read once, here
    for result in results:
        print_result(json.dumps(result) if args.json else str(result.get("text") or result["token_ids"]))
    return 0
