"""The server side of `dsa-serve bench serve`: start `serve`'s app here (or use --url), and run the closed-loop levels
over HTTP and on an in-process engine over rank workers started like the server's (load.py times the requests).
Both workloads of `bench serve` (serve.py, serve_long.py) measure through these functions.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

from cluster.serve_settings import API_KEY_ENV

READY_TIMEOUT_S = 300
SERVE_FLAGS = ("url", "model", "cp_size", "cp_strategy", "cp_impl", "ep_size", "ray_address", "speculative_num_steps", "dtype",
               "device", "engine_placement", "concurrency", "num_prompts", "max_tokens", "prompt_len", "warmup", "skip_in_process",
               "skip_transformers")  # the result's `command` (never --api-key)


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
