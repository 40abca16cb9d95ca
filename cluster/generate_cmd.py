"""`dsa-serve generate`: complete prompts through the engine and print the results (text, or JSON lines).

Without --cp-size the engine runs in this process (C = 1); with it, on a CP group of Ray actors.
--n-requests N runs N requests concurrently (cycling over the prompts, seed + i for request i).
"""

from __future__ import annotations

import argparse
import json

import torch

from .cp_args import add_cp_arguments

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    parser.add_argument("--speculative-num-steps", type=int, default=0, help="MTP draft tokens per step, 0..4")


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="complete prompts with a local model")
    parser.add_argument("--model", default=None, help="checkpoint folder (config.json + *.safetensors)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeatable; needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    add_sampling_arguments(parser)
    parser.add_argument("--n-requests", type=int, default=1, help="requests run concurrently (one JSON line each)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object per request")
    add_cp_arguments(parser)
    parser.set_defaults(run=run)


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
        ("--speculative-num-steps", 0 <= args.speculative_num_steps <= 4, "in 0..4"),
        ("--logprobs", args.logprobs is None or args.logprobs >= 0, ">= 0"),
    ]
    for flag, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{flag} must be {allowed}, got {getattr(args, flag[2:].replace('-', '_'))}")


def run(args: argparse.Namespace) -> int:
    from model_workers.generation import resolve_model_dir

    from .cp_cmd import run_generate

    check_arguments(args)
    results = run_generate(args, resolve_model_dir(args.model))
    for result in results:
        print(json.dumps(result) if args.json else result.get("text") or result["token_ids"])
    return 0
