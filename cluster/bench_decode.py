"""`dsa-serve bench decode`: tokens/s with MTP speculation (k draft tokens per step) at batch size B.

Every configuration runs B greedy (or sampled) requests concurrently through one engine, each generating
--max-tokens tokens (EOS ignored). Printed per configuration: tokens/s, the mean accepted length (tokens
emitted per verify step), per-position acceptance, and next to it the formula (1 - a^(k+1)) / (1 - a)
with a = accepted / drafted; plus the engine overhead (step wall time not spent in the rank's compute).
"""

from __future__ import annotations

import argparse
import json
import shlex
import time

PROMPTS = (
    "def __init__(self", "import os\nimport sys\n\n", "class Parser:\n    ", "for i in range(",
    "    return self.", "if __name__ == '__main__':\n", "def read(path):\n    with open(", "# Copyright",
)
FORMULA = "(1 - a^(k+1)) / (1 - a), a = accepted / drafted"


def add_parser(kinds) -> None:
    decode = kinds.add_parser("decode", help="decode tokens/s with MTP speculation (k = 0 is plain decoding)")
    decode.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    decode.add_argument("--speculative-num-steps", default="0", help="k, or a comma list (e.g. 0,1,2,3)")
    decode.add_argument("--batch-size", default="1", help="B, or a comma list (e.g. 1,8)")
    decode.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    decode.add_argument("--temperature", type=float, default=0.0)
    decode.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    decode.add_argument("--steps-per-call", type=int, default=4, help="decode steps per worker call")
    decode.add_argument("--json", action="store_true", help="print one JSON object")
    decode.set_defaults(run=run_decode)


def int_list(text: str, flag: str, low: int, high: int) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not all(low <= v <= high for v in values):
        raise ValueError(f"{flag} values must be in {low}..{high}, got {text!r}")
    return values


def spelled_command(kind: str, args: argparse.Namespace, names: tuple[str, ...]) -> str:
    """`dsa-serve bench KIND --flag value ...` with every setting in `names` spelled out (flags set to True
    appear bare, False / None ones are left out) and --json: the command that reproduces the result."""
    words = ["dsa-serve", "bench", kind]
    for name in names:
        value = getattr(args, name)
        if value is None or value is False:
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(str(value))
    return shlex.join(words + ["--json"])


def formula(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def measure(model_dir, k: int, batch: int, args) -> dict:
    from cluster.engine_launch import EngineOptions, run_all, start_local_engine
    from cluster.engine_protocol import EngineRequest
    from model_workers.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [encode(tokenizer, p) if tokenizer else [1 + i, 2 + i, 3 + i] for i, p in enumerate(PROMPTS)]
    options = EngineOptions(args.dtype, num_pages=batch * (args.max_tokens // 16 + 4), page_size=16,
                            num_speculative_steps=k, max_steps_per_call=args.steps_per_call)
    engine = start_local_engine(model_dir, options)

    def requests(tag: str, max_tokens: int):
        return [EngineRequest(f"{tag}{i}", tuple(prompts[i % len(prompts)]), max_tokens, args.temperature,
                              ignore_eos=True, seed=i) for i in range(batch)]

    run_all(engine, requests("warm", 8))
    before = engine.stats.__dict__.copy()
    before["accepted_per_position"] = list(engine.stats.accepted_per_position)
    start = time.perf_counter()
    results = run_all(engine, requests("r", args.max_tokens))
    wall_s = time.perf_counter() - start
    return summarize(engine.stats, before, k, batch, wall_s, sum(len(r["token_ids"]) for r in results))


def summarize(stats, before: dict, k: int, batch: int, wall_s: float, tokens: int) -> dict:
    drafted, accepted = stats.drafted - before["drafted"], stats.accepted - before["accepted"]
    per_position = [n - b for n, b in zip(stats.accepted_per_position, before["accepted_per_position"])]
    verify_steps = drafted // k if k else 0
    a = accepted / drafted if drafted else 0.0
    step_wall = stats.step_wall_s - before["step_wall_s"]
    compute = stats.worker_compute_s - before["worker_compute_s"]
    return {
        "speculative_num_steps": k, "batch_size": batch, "tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "mean_accepted_length": (accepted + verify_steps) / verify_steps if verify_steps else 1.0,
        "acceptance_rate": a, "formula_accepted_length": formula(a, k) if k else 1.0,
        "per_position_acceptance": [n / verify_steps for n in per_position] if verify_steps else [],
        "engine_steps": stats.steps - before["steps"],
        "engine_overhead_fraction": 1 - compute / step_wall if step_wall else 0.0,
    }


def run_decode(args: argparse.Namespace) -> int:
    from model_workers.generation import resolve_model_dir

    ks = int_list(args.speculative_num_steps, "--speculative-num-steps", 0, 4)
    batches = int_list(args.batch_size, "--batch-size", 1, 256)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    model_dir = resolve_model_dir(args.model)
    runs = [measure(model_dir, k, batch, args) for batch in batches for k in ks]
    for run in runs:
        base = next(r for r in runs if r["batch_size"] == run["batch_size"])
        run["speedup_vs_first_k"] = run["tokens_per_s"] / base["tokens_per_s"]
    result = {"bench": "decode", "model": str(model_dir), "dtype": args.dtype, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "formula": FORMULA, "runs": runs}
    if args.json:
        print(json.dumps(result))
    else:
        for run in runs:
            print(f"k={run['speculative_num_steps']} B={run['batch_size']}: {run['tokens_per_s']:.1f} tok/s,"
                  f" accepted length {run['mean_accepted_length']:.2f} (formula {run['formula_accepted_length']:.2f})")
    return 0
