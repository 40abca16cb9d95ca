"""`dsa-serve bench decode`: tokens/s with MTP speculation (k draft tokens per step) at batch size B.

Every configuration runs greedy (or sampled) requests B at a time through its own engine, each generating
--max-tokens tokens (EOS ignored), until every prompt of PROMPTS has run at least once, --rounds times; the
configurations of one batch size take turns pass by pass (in-process or Ray engines all up at once). Reported per
configuration: tokens/s; mean accepted length E and per-position acceptance next to (1 - a^(k+1)) / (1 - a);
the draft cost c per token and verify cost v in plain steps, with the speedup E / (k·c + v) they predict;
and the engine overhead per decode step: 1 - (model forward time) / (step wall time).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

from cluster.bench.common import PROMPTS, model_fingerprint, spelled_command
from cluster.commands.args import (
    add_attention_backend_argument,
    add_cuda_graph_argument,
    add_deterministic_argument,
    add_dtype_argument,
    add_speculative_argument,
    int_list,
)
from cluster.commands.result_output import print_result
from cluster.config import MAX_SPECULATIVE_STEPS

FORMULA = "(1 - a^(k+1)) / (1 - a), a = accepted / drafted"
SPEEDUP_FORMULA = "E / (k*c + v): E mean accepted length, c draft cost per token and v verify cost, in plain steps"
DECODE_FLAGS = ("model", "speculative_num_steps", "speculative_token_map", "batch_size", "max_tokens", "temperature",
                "dtype", "steps_per_call", "rounds", "ray", "enable_deterministic_inference")


def add_parser(kinds) -> None:
    decode = kinds.add_parser("decode", help="decode tokens/s with MTP speculation (k = 0 is plain decoding)")
    decode.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    add_speculative_argument(decode, default="0,1,2,3,4", many=True)
    decode.add_argument("--batch-size", default="1,8,32", help="B, or a comma list")
    decode.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    decode.add_argument("--temperature", type=float, default=0.0)
    add_dtype_argument(decode, default="bfloat16", allow_auto=False)
    decode.add_argument("--steps-per-call", type=int, default=4, help="decode steps per worker call")
    decode.add_argument("--rounds", type=int, default=2,
                        help="passes over the prompts per configuration; the ks of a batch size take turns")
    add_deterministic_argument(decode)
    add_attention_backend_argument(decode)
    add_cuda_graph_argument(decode)
    decode.add_argument("--ray", action="store_true",
                        help="decode on a Ray worker actor as `serve` does (default: a worker in this process)")
    decode.add_argument("--json", action="store_true", help="print one JSON object")
    decode.add_argument("--plot", default=None, help="also draw the results into this PNG")
    decode.set_defaults(run=run_decode)


def formula(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def measure_batch(model_dir, ks: list[int], batch: int, args) -> list[dict]:
    """One result per k at batch size `batch`. Every k has its own engine, all up at once, and they take turns:
    --rounds passes, each running every prompt at least once (B at a time) on each engine, the order of the ks
    reversed every other pass, so a slow spell of a shared machine taxes every k alike."""
    from cluster.engine_setup import run_all
    from cluster.engine_spec import EngineOptions
    from cp_router.protocol import EngineRequest
    from model_workers.checkpoint.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [encode(tokenizer, p) if tokenizer else [1 + i, 2 + i, 3 + i] for i, p in enumerate(PROMPTS)]
    options = {k: EngineOptions(args.dtype, num_pages=batch * (args.max_tokens // 16 + 4), page_size=16,
                                num_speculative_steps=k, max_steps_per_call=args.steps_per_call,
                                deterministic=args.enable_deterministic_inference,
                                speculative_token_map=args.speculative_token_map,
                                attention_backend=args.attention_backend,
                                disable_cuda_graph=args.disable_cuda_graph,
                                enable_prefix_caching=False) for k in ks}  # every round prefills its prompts
    engines, close = open_engines(model_dir, options, args.ray)

    def requests(tag: str, max_tokens: int, first: int):
        return [EngineRequest(f"{tag}{i}", tuple(prompts[i % len(prompts)]), max_tokens, args.temperature,
                              ignore_eos=True, seed=i) for i in range(first, first + batch)]

    def one_pass(engine, tag: str) -> int:
        return sum(len(r["token_ids"]) for first in range(0, max(batch, len(PROMPTS)), batch)
                   for r in run_all(engine, requests(tag, args.max_tokens, first)))

    try:
        for engine in engines.values():
            run_all(engine, requests("warm", 8, 0))
        before = {k: copy.deepcopy(engine.stats) for k, engine in engines.items()}
        wall_s, tokens = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0)
        for round_index in range(args.rounds):
            for k in ks if round_index % 2 == 0 else ks[::-1]:
                start = time.perf_counter()
                tokens[k] += one_pass(engines[k], f"r{round_index}-")
                wall_s[k] += time.perf_counter() - start
        return [summarize(engines[k].stats, before[k], k, batch, wall_s[k], tokens[k]) for k in ks]
    finally:
        close()


def open_engines(model_dir, options: dict, use_ray: bool):
    """({k: engine}, close): C = 1 engines (one per entry of `options`) over in-process workers, or over one Ray
    worker actor each."""
    from cluster.engine_setup import start_local_engine
    from cluster.engine_spec import LOCAL_CP

    if not use_ray:  # no Ray imported: C = 1 runs where `import ray` fails
        return {k: start_local_engine(model_dir, o) for k, o in options.items()}, lambda: None
    import ray

    from cluster.launch import engine_cpus, start_ray
    from cluster.ray_engine import start_engine

    started = start_ray(len(options) * engine_cpus(1), None)
    pairs = {k: start_engine(model_dir, LOCAL_CP, o) for k, o in options.items()}

    def close():
        for _, group in pairs.values():
            group.shutdown()
        if started:
            ray.shutdown()
    return {k: engine for k, (engine, _) in pairs.items()}, close


def summarize(stats, before, k: int, batch: int, wall_s: float, tokens: int) -> dict:
    drafted, accepted = stats.drafted - before.drafted, stats.accepted - before.accepted
    per_position = [n - b for n, b in zip(stats.accepted_per_position, before.accepted_per_position)]
    steps = {p: stats.decode_loop_steps.get(p, 0) - before.decode_loop_steps.get(p, 0)
             for p in ("plain", "speculative")}
    model_s = {p: stats.decode_model_s.get(p, 0.0) - before.decode_model_s.get(p, 0.0)
               for p in ("plain", "draft", "verify")}
    verify_steps = drafted // k if k else 0  # request-steps: one per request per verification
    a = accepted / drafted if drafted else 0.0
    only_wall = stats.decode_only_wall_s - before.decode_only_wall_s
    only_model = stats.decode_only_model_s - before.decode_only_model_s
    return {
        "speculative_num_steps": k, "batch_size": batch, "tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "mean_accepted_length": (accepted + verify_steps) / verify_steps if verify_steps else 1.0,
        "acceptance_rate": a, "formula_accepted_length": formula(a, k) if k else 1.0,
        "per_position_acceptance": [n / verify_steps for n in per_position] if verify_steps else [],
        "engine_steps": stats.steps - before.steps, "decode_loop_steps": steps, "decode_model_s": model_s,
        "decode_only_steps": stats.decode_only_steps - before.decode_only_steps,
        "engine_overhead_fraction": 1 - only_model / only_wall if only_wall else 0.0,
    }


def add_cost_model(runs: list[dict]) -> None:
    """c (one draft token) and v (one verification) in units of a plain step at the same batch size, and
    the speedup they predict, E / (k·c + v); needs the k = 0 run of that batch size."""
    for run in runs:
        base = next((r for r in runs if r["batch_size"] == run["batch_size"] and r["speculative_num_steps"] == 0), None)
        k, steps = run["speculative_num_steps"], run["decode_loop_steps"]["speculative"]
        if base is None or not k or not steps or not base["decode_loop_steps"]["plain"]:
            continue
        plain_step_s = base["decode_model_s"]["plain"] / base["decode_loop_steps"]["plain"]
        run["draft_cost_c"] = run["decode_model_s"]["draft"] / (steps * k) / plain_step_s
        run["verify_cost_v"] = run["decode_model_s"]["verify"] / steps / plain_step_s
        run["predicted_speedup"] = run["mean_accepted_length"] / (k * run["draft_cost_c"] + run["verify_cost_v"])


def run_decode(args: argparse.Namespace) -> int:
    from model_workers.checkpoint.model_dir import resolve_model_dir

    ks = int_list(args.speculative_num_steps, "--speculative-num-steps", 0, MAX_SPECULATIVE_STEPS)
    batches = int_list(args.batch_size, "--batch-size", 1, 256)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.plot:
        from cluster.bench.render import require_matplotlib
        require_matplotlib()
    model_dir = resolve_model_dir(args.model)
    runs = [run for batch in batches for run in measure_batch(model_dir, ks, batch, args)]
    for run in runs:
        base = next(r for r in runs if r["batch_size"] == run["batch_size"])
        run["speedup_vs_first_k"] = run["tokens_per_s"] / base["tokens_per_s"]
    add_cost_model(runs)
    result = {"bench": "decode", "command": spelled_command("decode", args, DECODE_FLAGS), "model": str(model_dir),
              "model_fingerprint": model_fingerprint(model_dir),
              "dtype": args.dtype, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "deterministic": args.enable_deterministic_inference, "rounds": args.rounds,
              "engine": "ray worker" if args.ray else "in-process worker", "formula": FORMULA,
              "speedup_formula": SPEEDUP_FORMULA, "runs": runs}
    if args.plot:
        from cluster.bench.plot import save_plot
        save_plot(result, args.plot)
    if args.json:
        print_result(json.dumps(result))
    else:
        for run in runs:
            print_result(f"k={run['speculative_num_steps']} B={run['batch_size']}: {run['tokens_per_s']:.1f} tok/s,"
                         f" accepted length {run['mean_accepted_length']:.2f}"
                         f" (formula {run['formula_accepted_length']:.2f})")
    return 0
