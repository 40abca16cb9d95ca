"""`dsa-serve bench serve`: a load generator: the HTTP server under a closed-loop load, next to the in-process engine.

For every --concurrency level C, C clients send --num-prompts streamed greedy completions back to back (each
exactly --max-tokens tokens) to `POST /v1/completions` of --url (a running OpenAI-compatible server), or of a server
this command starts the way `dsa-serve serve` does, on a local Ray it starts and stops. The same requests run at the
same concurrency on a `DSAEngine` in this process, over rank workers started like the server's (Ray actors, the
same EngineOptions), in rounds alternating with the HTTP ones (serve_server.measure_paths, so a slow spell of this
shared machine taxes both alike), and HTTP / in-process is the serving overhead (Serve + HTTP + SSE); with
--skip-in-process only the HTTP side runs. Timing definitions: load.py.
With --url, --model/--cp-*/--speculative-num-steps/--dtype/--device must describe that server (the in-process
engine is built from them); the model name is checked.
With --json the JSON object is the last line of stdout (Ray may print lines of its own before it).
`--workload shared-prefix` measures the prefix cache: two servers, cache on and off, on the same shared-prefix
requests in one run (shared_prefix_run.py).
The `transformers` comparisons are the repository's harness (not installed): `python -m benchmarks serve` runs this
command's measurement plus batched `transformers` generate on the same prompts, and `--workload long` (held-out
prompts of 4k-16k tokens, the prefill's FLOP efficiency); see docs/benchmarks.md. Here the result's `transformers`
block says it was skipped and why.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from cluster.bench.common import MIN_REQUESTS_PER_LEVEL, PROMPTS, model_fingerprint, spelled_command
from cluster.bench.serve_result import DEFINITIONS, assemble_run, machine, plot, summary_text
from cluster.bench.serve_server import NEGATABLE_FLAGS, SERVE_FLAGS, measure_served, server_info
from cluster.bench.shared_prefix import WORKLOAD as SHARED_PREFIX
from cluster.bench.shared_prefix import add_shared_prefix_arguments, reject_shared_prefix_flags, resolve_shared_prefix
from cluster.commands.args import add_server_arguments, int_list
from cluster.commands.result_output import print_result
from cluster.config import check_speculative_steps
from cluster.serve_settings import API_KEY_ENV

WORKLOADS = ("short", "long", SHARED_PREFIX)
DEFAULT_SHORT_CONCURRENCY = "1,8,32,64"
HARNESS_BASELINE = "the transformers baseline runs in the repository's harness: python -m benchmarks serve"
LONG_IN_HARNESS = ("--workload long compares against transformers and runs in the repository's harness, from a "
                   "checkout: python -m benchmarks serve --workload long ... (docs/benchmarks.md)")


def add_parser(kinds) -> None:
    bench = kinds.add_parser("serve", help="HTTP server under a closed-loop load: TTFT, ITL, tokens/s vs in-process")
    add_arguments(bench)
    bench.set_defaults(run=run)


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """The flags of `dsa-serve bench serve`, which the harness's `python -m benchmarks serve` shares."""
    bench.add_argument("--url", default=None, help="a running server (default: start one here, stop it at the end)")
    add_server_arguments(bench, dtype_default="bfloat16")
    bench.add_argument("--workload", choices=WORKLOADS, default="short",
                       help="short: short code prompts (or --prompt-len random ones); long: held-out prompts of "
                            "4k-16k tokens against transformers, run by the harness (python -m benchmarks serve); "
                            "shared-prefix: documents asked several questions and multi-turn chats, the prefix "
                            "cache on against off")
    bench.add_argument("--concurrency", default=None, help="comma list of closed-loop client counts (default "
                                                           "1,8,32,64; --workload long: 1,4; --workload "
                                                           "shared-prefix: one level, 32, its no-sharing phase)")
    bench.add_argument("--num-prompts", type=int, default=None,
                       help="requests per level and path, split over the alternating rounds (default max(32, 4 x C);"
                            " --workload long: the largest C, in one round)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (exactly)")
    bench.add_argument("--prompt-len", type=int, default=0, help="random prompts of this many tokens "
                                                                 "(default 0: short Python code prompts)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed requests before each measured path")
    bench.add_argument("--api-key", default=None, help=f"Bearer key for --url (default: env {API_KEY_ENV})")
    bench.add_argument("--skip-in-process", action=argparse.BooleanOptionalAction, default=None,
                       help="no in-process engine (no overhead ratios; default for --workload long)")
    bench.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                       help="the server it starts answers at its HTTP replica, no Serve proxy hop, as `serve` does "
                            "by default with one replica (default: on; --no-direct-ingress: through Serve's proxy)")
    bench.add_argument("--skip-transformers", action="store_true",
                       help="no transformers generate baseline (it runs only in `python -m benchmarks serve`)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the results into this image")
    add_shared_prefix_arguments(bench)


def short_workload(args: argparse.Namespace) -> None:
    """The short workload's defaults; ValueError for --workload long, which the harness runs."""
    if args.workload == "long":
        raise ValueError(LONG_IN_HARNESS)
    reject_shared_prefix_flags(args)
    args.concurrency = args.concurrency or DEFAULT_SHORT_CONCURRENCY
    args.skip_in_process = bool(args.skip_in_process)


def check_arguments(args: argparse.Namespace, resolve_workload: Callable = short_workload) -> list[int]:
    """The concurrency levels (`resolve_workload` fills in the workload's defaults); ValueError naming the flag for
    anything out of range."""
    resolve_workload(args)
    levels = list(dict.fromkeys(int_list(args.concurrency, "--concurrency", 1, 256)))
    for flag, value, low in [("--max-tokens", args.max_tokens, 1), ("--prompt-len", args.prompt_len, 0),
                             ("--warmup", args.warmup, 0), ("--cp-size", args.cp_size, 1),
                             ("--num-prompts", 1 if args.num_prompts is None else args.num_prompts, 1)]:
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    check_speculative_steps(args.speculative_num_steps, "--speculative-num-steps")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    if args.plot is not None:
        check_plot_path(args.plot)
    if args.direct_ingress is not None and args.url is not None:
        raise ValueError("--direct-ingress / --no-direct-ingress set up the server this command starts; with --url, "
                         "start that server with `dsa-serve serve --direct-ingress` (or --no-direct-ingress) instead")
    if args.url is None and args.direct_ingress is None:
        args.direct_ingress = True  # what `serve` does with one replica
    return levels


def check_plot_path(path: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'dsa-serve[bench]'") from None
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"--plot: the folder of {path} does not exist")


def build_prompts(model_dir: Path, prompt_len: int) -> list[tuple[str | list[int], list[int]]]:
    """(what the HTTP request sends, the token ids) per prompt: code prompts as text, else random token ids."""
    from model_workers.checkpoint.tokenizer import encode, load_tokenizer
    from model_workers.checkpoint.model_dir import load_model_config

    tokenizer = load_tokenizer(model_dir)
    if prompt_len == 0 and tokenizer is not None:
        return [(text, encode(tokenizer, text)) for text in PROMPTS]
    generator = torch.Generator().manual_seed(0)
    length, vocab = prompt_len or 8, load_model_config(model_dir).vocab_size
    token_lists = [torch.randint(1, vocab, (length,), generator=generator).tolist() for _ in range(len(PROMPTS))]
    return [(ids, ids) for ids in token_lists]


def build_result(args, model_dir: Path, cp, prompts: list, levels: list[int], http: dict, in_process: dict | None,
                 baseline: dict) -> dict:
    return {
        "bench": "serve", "command": spelled_command("serve", args, SERVE_FLAGS, NEGATABLE_FLAGS),
        "model": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "dtype": args.dtype, "device": args.device, "max_tokens": args.max_tokens,
        "prompt_tokens": [len(ids) for _, ids in prompts], "machine": machine(), "server": server_info(args, cp),
        "definitions": DEFINITIONS,
        "in_process": {"skipped": True, "reason": "--skip-in-process"} if in_process is None else {"skipped": False},
        "transformers": {k: v for k, v in baseline.items() if k != "levels"},
        "runs": [assemble_run(c, http[c], (in_process or {}).get(c), baseline.get("levels", {}).get(c))
                 for c in levels],
    }


def run(args: argparse.Namespace) -> int:
    if args.workload == SHARED_PREFIX:
        from cluster.bench.shared_prefix_run import run_shared_prefix

        return run_shared_prefix(args, check_arguments(args, resolve_shared_prefix))
    return run_short(args, check_arguments(args))


def run_short(args: argparse.Namespace, levels: list[int], baseline_fn: Callable | None = None) -> int:
    """The short workload, start to end (after `check_arguments`); prints the result. `baseline_fn(model_dir,
    level_prompts, max_tokens, dtype, device, threads)` is the harness's `transformers` baseline (None: skipped)."""
    from cluster.commands.serve import app_args
    from cluster.config import resolve_cp_settings
    from model_workers.checkpoint.model_dir import read_model_spec

    settings = app_args(args)
    model = read_model_spec(settings.model)
    model_dir = model.path
    cp = resolve_cp_settings(settings, model)
    prompts = build_prompts(model_dir, args.prompt_len)
    plan = {c: args.num_prompts or max(MIN_REQUESTS_PER_LEVEL, 4 * c) for c in levels}
    http, in_process, _ = measure_served(args, model_dir, cp, settings, {None: (prompts, plan)})
    http, in_process = http[None], in_process and in_process[None]
    reason = "--skip-transformers" if args.skip_transformers else HARNESS_BASELINE
    baseline = {"skipped": True, "reason": reason}
    if baseline_fn is not None and not args.skip_transformers:
        level_prompts = {c: [prompts[i % len(prompts)][1] for i in range(n)] for c, n in plan.items()}
        baseline = baseline_fn(model_dir, level_prompts, args.max_tokens, args.dtype, args.device, cp.cp_size)
    result = build_result(args, model_dir, cp, prompts, levels, http, in_process, baseline)
    print_result(json.dumps(result) if args.json else summary_text(result))
    if args.plot:
        plot(result, args.plot)
    return 0
