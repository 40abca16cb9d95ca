"""`dsa-serve bench serve`: the HTTP server under a closed-loop load, next to the in-process engine and `transformers`.

For every --concurrency level C, C clients send --num-prompts streamed greedy completions back to back (each
exactly --max-tokens tokens) to `POST /v1/completions` of --url, or of a server this command starts the way
`dsa-serve serve` does, on a local Ray it starts and stops. The same requests run (first) at the same
concurrency on a `DSAEngine` in this process, over rank workers started like the server's (Ray actors, the
same EngineOptions), so HTTP / in-process is the serving overhead (Serve + HTTP + SSE). Last, the same prompts
run through `transformers` `generate` in batches of C (transformers_baseline.py). Timing definitions: load.py.
With --url, --model/--cp-*/--speculative-num-steps/--dtype/--device must describe that server (the in-process
engine and the baseline are built from them); the model name is checked.
With --json the JSON object is the last line of stdout (Ray may print lines of its own before it).
`--workload long` (held-out prompts of 4k-16k tokens, transformers one request at a time, the prefill's FLOP
efficiency) is cluster/bench/serve_long.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from pathlib import Path

import torch

from cluster.bench.common import PROMPTS, spelled_command
from cluster.bench.serve_long import add_long_arguments, resolve_workload
from cluster.bench.serve_report import (  # plot: bench_plot "serve"
    DEFINITIONS,
    assemble_run,
    machine,
    plot,
    summary_text,
)
from cluster.commands.args import add_server_arguments, int_list
from cluster.config import check_speculative_steps
from cluster.serve_settings import API_KEY_ENV

READY_TIMEOUT_S = 300
SERVE_FLAGS = ("url", "model", "cp_size", "cp_strategy", "cp_impl", "ep_size", "ray_address", "speculative_num_steps", "dtype",
               "device", "engine_placement", "concurrency", "num_prompts", "max_tokens", "prompt_len", "warmup", "skip_in_process",
               "skip_transformers")  # the result's `command` (never --api-key)


def add_parser(kinds) -> None:
    bench = kinds.add_parser("serve", help="HTTP server under load: TTFT, ITL, tokens/s vs in-process and transformers")
    bench.add_argument("--url", default=None, help="a running server (default: start one here, stop it at the end)")
    add_server_arguments(bench, dtype_default="bfloat16")
    add_long_arguments(bench)
    bench.add_argument("--concurrency", default=None, help="comma list of closed-loop client counts (default "
                                                           "1,8,32,64; --workload long: 1,4)")
    bench.add_argument("--num-prompts", type=int, default=None, help="requests per level (default max(16, 2 x C);"
                                                                     " --workload long: the largest C)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (exactly)")
    bench.add_argument("--prompt-len", type=int, default=0, help="random prompts of this many tokens "
                                                                 "(default 0: short Python code prompts)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed requests before each measured path")
    bench.add_argument("--api-key", default=None, help=f"Bearer key for --url (default: env {API_KEY_ENV})")
    bench.add_argument("--skip-in-process", action=argparse.BooleanOptionalAction, default=None,
                       help="no in-process engine (no overhead ratios; default for --workload long)")
    bench.add_argument("--skip-transformers", action="store_true", help="no transformers generate baseline")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the results into this image")
    bench.set_defaults(run=run)


def check_arguments(args: argparse.Namespace) -> list[int]:
    """The concurrency levels (the workload's defaults filled in); ValueError naming the flag for anything out of
    range."""
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
    from model_workers.model.config import load_model_config

    tokenizer = load_tokenizer(model_dir)
    if prompt_len == 0 and tokenizer is not None:
        return [(text, encode(tokenizer, text)) for text in PROMPTS]
    generator = torch.Generator().manual_seed(0)
    length, vocab = prompt_len or 8, load_model_config(model_dir).vocab_size
    token_lists = [torch.randint(1, vocab, (length,), generator=generator).tolist() for _ in range(len(PROMPTS))]
    return [(ids, ids) for ids in token_lists]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(settings) -> str:
    """The app of `dsa-serve serve` (one engine replica) on a free local port; its URL.

    Serve runs on the Ray this command started and goes down with it (`ray.shutdown`).
    """
    from ray import serve

    from cluster.serve_app import APP_NAME, build_application

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_application(settings, 1), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def served_models(url: str, headers: dict) -> list[str]:
    """The model ids of GET /v1/models, waiting until the server answers."""
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10, trust_env=False)
            if response.status_code == 200:
                return [card["id"] for card in response.json()["data"]]
            problem = f"status {response.status_code}: {response.text[:200]}"
        except httpx.TransportError as exc:
            problem = repr(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/v1/models not ready within {READY_TIMEOUT_S}s ({problem})")
        time.sleep(1)


async def run_groups(send, groups: dict, warmup: int) -> dict:
    """`warmup` untimed requests of the first group's prompts, then every group's closed loops in order.

    `groups` maps a key (None for the short workload, the prompt length for the long one) to (prompts, plan:
    {concurrency: requests}); `send(prompts, i)` sends request i. Returns {key: {concurrency: summary}}."""
    from cluster.bench.load import closed_loop, summarize

    first = next(iter(groups.values()))[0]
    for i in range(warmup):
        await send(first, i)
    out = {}
    for key, (prompts, plan) in groups.items():
        out[key] = {c: summarize(*await closed_loop(lambda i, p=prompts: send(p, i), n, c)) for c, n in plan.items()}
    return out


async def http_levels(url: str, headers: dict, groups: dict, args) -> dict:
    import httpx

    from cluster.bench.load import completion_body, http_request

    most = max(c for _, plan in groups.values() for c in plan)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits, headers=headers,
                                 trust_env=False) as client:
        def send(prompts: list, i: int):
            return http_request(client, url, completion_body(prompts[i % len(prompts)][0], args.max_tokens))

        return await run_groups(send, groups, args.warmup)


def in_process_levels(model_dir: Path, cp, settings, groups: dict, args) -> dict:
    from cluster.bench.load import engine_request
    from cluster.engine_setup import start_engine
    from cluster.serve_app import engine_options
    from cp_router.protocol import EngineRequest

    engine, group = start_engine(model_dir, cp, engine_options(settings, model_dir))
    ids = iter(range(1 << 62))

    def send(prompts: list, i: int):
        request = EngineRequest(f"bench-{next(ids)}", tuple(prompts[i % len(prompts)][1]), args.max_tokens,
                                temperature=0.0, min_tokens=args.max_tokens)
        return engine_request(engine, request)

    try:
        return asyncio.run(run_groups(send, groups, args.warmup))
    finally:
        group.shutdown()


def measure_served(args, model_dir: Path, cp, settings, groups: dict, after=None) -> tuple[dict, dict | None, object]:
    """In-process results per group and level (None when skipped), then HTTP ones (server started here unless
    --url), then `after()` (if given) on the same Ray once the server this command started is stopped."""
    from cluster.launch import engine_cpus, start_ray

    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    needs_ray = args.url is None or not args.skip_in_process or after is not None
    started_ray = needs_ray and start_ray(1 + engine_cpus(cp.cp_size), args.ray_address)
    if args.url is None and not started_ray:
        raise ValueError("--url is required on a Ray cluster this command joins (--ray-address, $RAY_ADDRESS): "
                         "it starts its own server only on a Ray it starts")
    try:
        in_process = None if args.skip_in_process else in_process_levels(model_dir, cp, settings, groups, args)
        url = args.url.rstrip("/") if args.url else start_server(settings)
        models = served_models(url, headers)
        if model_dir.name not in models:
            raise ValueError(f"--url serves {models}, not {model_dir.name!r}: pass the --model that server runs")
        http = asyncio.run(http_levels(url, headers, groups, args))
        if after is None:
            return http, in_process, None
        if args.url is None:
            from ray import serve

            serve.shutdown()
        return http, in_process, after()
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def server_info(args, cp) -> dict:
    """The `server` block of a result: where it ran and with which CP / speculation / placement settings."""
    return {"url": args.url, "started_here": args.url is None, "cp_size": cp.cp_size, "cp_strategy": cp.strategy,
            "cp_impl": cp.impl, "speculative_num_steps": args.speculative_num_steps,
            "engine_placement": args.engine_placement}


def build_result(args, model_dir: Path, cp, prompts: list, levels: list[int], http: dict, in_process: dict | None,
                 baseline: dict) -> dict:
    return {
        "bench": "serve", "command": spelled_command("serve", args, SERVE_FLAGS), "model": str(model_dir),
        "dtype": args.dtype, "device": args.device, "max_tokens": args.max_tokens,
        "prompt_tokens": [len(ids) for _, ids in prompts], "machine": machine(), "server": server_info(args, cp),
        "definitions": DEFINITIONS,
        "in_process": {"skipped": True, "reason": "--skip-in-process"} if in_process is None else {"skipped": False},
        "transformers": {k: v for k, v in baseline.items() if k != "levels"},
        "runs": [assemble_run(c, http[c], (in_process or {}).get(c), baseline.get("levels", {}).get(c))
                 for c in levels],
    }


def run(args: argparse.Namespace) -> int:
    from cluster.bench.transformers_baseline import run_baseline
    from cluster.commands.serve import app_args
    from cluster.config import resolve_cp_settings
    from model_workers.checkpoint.model_dir import resolve_model_dir

    levels = check_arguments(args)
    if args.workload == "long":
        from cluster.bench.serve_long import run_long

        return run_long(args, levels)
    settings = app_args(args)
    model_dir = resolve_model_dir(settings.model)
    cp = resolve_cp_settings(settings, model_dir)
    prompts = build_prompts(model_dir, args.prompt_len)
    plan = {c: args.num_prompts or max(16, 2 * c) for c in levels}
    http, in_process, _ = measure_served(args, model_dir, cp, settings, {None: (prompts, plan)})
    http, in_process = http[None], in_process and in_process[None]
    baseline = {"skipped": True, "reason": "--skip-transformers"}
    if not args.skip_transformers:
        level_prompts = {c: [prompts[i % len(prompts)][1] for i in range(n)] for c, n in plan.items()}
        baseline = run_baseline(model_dir, level_prompts, args.max_tokens, args.dtype, args.device, cp.cp_size)
    result = build_result(args, model_dir, cp, prompts, levels, http, in_process, baseline)
    print(json.dumps(result) if args.json else summary_text(result))
    if args.plot:
        plot(result, args.plot)
    return 0
