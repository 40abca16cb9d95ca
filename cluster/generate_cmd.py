"""`dsa-serve generate`: complete one prompt and print the result (text, or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json

import torch

from .cp_args import add_cp_arguments

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="complete a prompt with a local model")
    parser.add_argument("--model", default=None, help="checkpoint folder (config.json + *.safetensors)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model folder)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_cp_arguments(parser)
    parser.set_defaults(run=run)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def run(args: argparse.Namespace) -> int:
    from model_workers.generation import LocalGenerator, resolve_model_dir

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.cp_size is not None:
        from .cp_cmd import run_generate_cp

        result = run_generate_cp(args, resolve_model_dir(args.model))
    else:
        generator = LocalGenerator.from_checkpoint(args.model, DTYPES[args.dtype], args.device)
        if args.prompt is not None:
            prompt_ids = generator.encode(args.prompt)
        else:
            prompt_ids = parse_prompt_ids(args.prompt_ids)
        result = generator.generate(prompt_ids, args.max_tokens, args.temperature, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print(result.get("text", result["token_ids"]))
    return 0
