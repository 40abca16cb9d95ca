"""The server side of `dsa-serve bench serve`: start `serve`'s app here (or use --url), and run the closed-loop levels
over HTTP and on an in-process engine over rank workers started like the server's, in alternating rounds while
both are up (load.py times the requests).
Both workloads of `bench serve` measure through these functions: the short one (serve.py) and the repository
harness's long one (benchmarks/serve_long.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from cluster.serve_settings import API_KEY_ENV
from model_workers.comm import free_port

READY_TIMEOUT_S = 300
SERVE_FLAGS = ("url", "model", "cp_size", "cp_strategy", "cp_impl", "ep_size", "ray_address", "speculative_num_steps",
               "dtype", "device", "engine_placement", "concurrency", "num_prompts", "max_tokens", "prompt_len", "warmup",
               "skip_in_process", "skip_transformers", "direct_ingress")  # the result's `command` (never --api-key)
NEGATABLE_FLAGS = ("direct_ingress",)  # spelled --no-... when False


def start_server(settings) -> str:
    """The app of `dsa-serve serve` (one engine replica), Serve's proxy on a free local port; its URL: the
    proxy's, or with direct ingress (settings.direct_ingress_port) the HTTP replica's own port.

    Serve runs on the Ray this command started and goes down with it (`ray.shutdown`).
    """
    return start_app(settings, start_proxy())


def start_proxy() -> int:
    """Serve on this Ray, its proxy on a free local port (returned)."""
    from ray import serve

    proxy_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    return proxy_port


def start_app(settings, proxy_port: int, name: str | None = None, route_prefix: str = "/") -> str:
    """One more app of `dsa-serve serve` (one engine replica) on the running Serve, named `name` (default `serve`'s
    own) at `route_prefix`; its URL: the proxy's at that prefix, or the HTTP replica's own port with direct
    ingress."""
    from ray import serve

    from cluster.serve_app import APP_NAME, build_application

    serve.run(build_application(settings, 1), name=name or APP_NAME, route_prefix=route_prefix)
    if settings.direct_ingress_port:
        return f"http://127.0.0.1:{settings.direct_ingress_port}"
    return f"http://127.0.0.1:{proxy_port}{route_prefix.rstrip('/')}"


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


ROUNDS = 2  # closed-loop rounds per path and level when two paths alternate (see measure_paths)


def round_sizes(requests: int, rounds: int) -> list[int]:
    """`requests` split over at most `rounds` rounds, as evenly as can be (earlier rounds take the remainder)."""
    rounds = min(rounds, requests)
    return [requests // rounds + (i < requests % rounds) for i in range(rounds)]


async def measure_paths(senders: dict, groups: dict, warmup: int) -> dict:
    """Every path's closed loops, interleaved so a slow spell of the machine taxes both paths alike.

    `senders` maps a path name ("http", "in_process") to `send(prompts, i)`, which sends request i; `groups` maps
    a key (None for the short workload, the prompt length for the long one) to (prompts, plan: {concurrency:
    requests}). Each path first gets `warmup` untimed requests of the first group's prompts; then, per group and
    level, its `requests` split over ROUNDS rounds (round_sizes), the paths taking turns A B, then B A; a
    lone path runs all its requests in one round. A path's summary covers all its rounds (tokens / summed
    wall time). Returns {path: {key: {concurrency: summary}}}."""
    from cluster.bench.load import closed_loop, summarize

    first = next(iter(groups.values()))[0]
    for send in senders.values():
        for i in range(warmup):
            await send(first, i)
    out: dict = {name: {} for name in senders}
    for key, (prompts, plan) in groups.items():
        for concurrency, requests in plan.items():
            runs = {name: ([], 0.0) for name in senders}
            for round_index, size in enumerate(round_sizes(requests, ROUNDS if len(senders) > 1 else 1)):
                order = list(senders) if round_index % 2 == 0 else list(senders)[::-1]
                for name in order:
                    timings, wall_s = await closed_loop(lambda i, p=prompts, s=senders[name]: s(p, i), size,
                                                        concurrency)
                    runs[name] = (runs[name][0] + timings, runs[name][1] + wall_s)
            for name, (timings, wall_s) in runs.items():
                out[name].setdefault(key, {})[concurrency] = summarize(timings, wall_s)
    return out


def http_sender(session, url: str, args):
    from cluster.bench.load import completion_body, http_request

    def send(prompts: list, i: int):
        return http_request(session, url, completion_body(prompts[i % len(prompts)][0], args.max_tokens))

    return send


def engine_sender(engine, args):
    from cluster.bench.load import engine_request
    from cp_router.protocol import EngineRequest

    ids = iter(range(1 << 62))

    def send(prompts: list, i: int):
        request = EngineRequest(f"bench-{next(ids)}", tuple(prompts[i % len(prompts)][1]), args.max_tokens,
                                temperature=0.0, min_tokens=args.max_tokens)
        return engine_request(engine, request)

    return send


async def measure_both(url: str, headers: dict, engine, groups: dict, args) -> dict:
    """measure_paths over HTTP (an aiohttp client, as `vllm bench serve` uses) and, when `engine` is given, on it
    in this process."""
    import aiohttp

    most = max(c for _, plan in groups.values() for c in plan)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=most), headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=600), read_bufsize=1 << 20,
                                     trust_env=False) as session:
        senders = {"http": http_sender(session, url, args)}
        if engine is not None:
            senders["in_process"] = engine_sender(engine, args)
        return await measure_paths(senders, groups, args.warmup)


def measure_served(args, model_dir: Path, cp, settings, groups: dict, after=None) -> tuple[dict, dict | None, object]:
    """HTTP results per group and level (server started here unless --url) and in-process ones (None when
    skipped), measured in alternating rounds while both are up (the idle one waits on an event, using no CPU),
    then `after()` (if given) on the same Ray once the server this command started is stopped."""
    from cluster.launch import engine_cpus, start_ray

    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    needs_ray = args.url is None or not args.skip_in_process or after is not None
    engines = (args.url is None) + (not args.skip_in_process)
    if args.direct_ingress:
        settings = settings.model_copy(update={"direct_ingress_port": free_port(), "direct_ingress_host": "127.0.0.1"})
    started_ray = needs_ray and start_ray(1 + max(1, engines) * engine_cpus(cp.cp_size), args.ray_address)
    if args.url is None and not started_ray:
        raise ValueError("--url is required on a Ray cluster this command joins (--ray-address, $RAY_ADDRESS): "
                         "it starts its own server only on a Ray it starts")
    try:
        results = measure_with_server(args, model_dir, cp, settings, groups, headers)
        http, in_process = results["http"], results.get("in_process")
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


def measure_with_server(args, model_dir: Path, cp, settings, groups: dict, headers: dict) -> dict:
    """measure_both against the server (started here unless --url; at its HTTP replica's own port with direct
    ingress) and, unless skipped, an in-process engine whose rank group is shut down when the measuring
    ends."""
    from cluster.ray_engine import start_engine
    from cluster.replica_engine import engine_options

    engine, group = (None, None) if args.skip_in_process else start_engine(model_dir, cp,
                                                                             engine_options(settings, model_dir))
    try:
        url = args.url.rstrip("/") if args.url else start_server(settings)
        models = served_models(url, headers)
        if model_dir.name not in models:
            raise ValueError(f"--url serves {models}, not {model_dir.name!r}: pass the --model that server runs")
        return asyncio.run(measure_both(url, headers, engine, groups, args))
    finally:
        if group is not None:
            group.shutdown()


def server_info(args, cp) -> dict:
    """The `server` block of a result: where it ran and with which CP / speculation / placement settings."""
    return {"url": args.url, "started_here": args.url is None, "cp_size": cp.cp_size, "cp_strategy": cp.strategy,
            "cp_impl": cp.impl, "speculative_num_steps": args.speculative_num_steps,
            "engine_placement": args.engine_placement,
            "direct_ingress": args.direct_ingress}  # None with --url: that server's own setting
