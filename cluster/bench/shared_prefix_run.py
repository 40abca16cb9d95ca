"""`dsa-serve bench serve --workload shared-prefix`: the prefix cache on against off, measured in one run.

Two servers of `serve`'s app, with the same settings except enable_prefix_caching (the cache-off one is what
--disable-radix-cache starts), run at once on a local Ray this command starts and stops: two Serve apps, each with
its own engine and rank workers (the idle one waits, using no CPU). With --url the cache-on side is that server and
--off-url, if given, a second one started with --disable-radix-cache; without --off-url only the cache-on side is
measured and the ratios are null. The cache-on server is emptied (`POST /flush_cache`, else vLLM's
`/reset_prefix_cache`) before each of its passes, so every pass starts cold and both sides send the same requests
(shared_prefix.py) into the same state, the cache aside.

Per side, after --warmup untimed requests: the documents (concurrency 1: first questions, then the later ones), the
chat (every conversation at once), each on, then off; then the no-sharing phase in --throughput-rounds alternating
rounds (on off, off on, ...) at --concurrency streams. The report: shared_prefix_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import asdict, dataclass
from functools import partial

from cluster.bench.common import MIN_REQUESTS_PER_LEVEL, model_fingerprint, spelled_command
from cluster.bench.load import closed_loop, completion_body, http_request
from cluster.bench.serve_result import machine
from cluster.bench.serve_server import NEGATABLE_FLAGS, served_models, server_info, start_app, start_proxy
from cluster.bench.shared_prefix import (
    WORKLOAD, Conversation, Sizes, conversations, distinct_prompts, document_passes, kv_pages, longest_prompt,
    run_conversations,
)
from cluster.bench.shared_prefix_report import (
    DEFINITIONS, SIDES, documents_summary, no_sharing_summary, plot, ratios_and_targets, side_summary, summary_text,
)
from cluster.commands.result_output import print_result
from cluster.serve_settings import API_KEY_ENV

RESULT_FLAGS = ("url", "off_url", "model", "cp_size", "cp_strategy", "cp_impl", "ep_size", "ray_address",
                "speculative_num_steps", "dtype", "device", "engine_placement", "workload", "doc_len", "num_docs",
                "questions_per_doc", "question_len", "conversations", "turns", "concurrency", "num_prompts",
                "prompt_len", "max_tokens", "throughput_rounds", "warmup", "direct_ingress", "num_kv_pages",
                "kv_cache_memory_gib")  # the result's `command` (never --api-key)
FLUSH_ROUTES = ("/flush_cache", "/reset_prefix_cache")  # SGLang's, vLLM's
FLUSH_TRIES = 5


@dataclass(frozen=True)
class Requests:
    first_questions: list[list[int]]
    later_questions: list[list[int]]
    conversations: list[Conversation]
    no_sharing: list[list[int]]


def build_requests(sizes: Sizes, vocab_size: int) -> Requests:
    first, later = document_passes(sizes, vocab_size)
    return Requests(first, later, conversations(sizes, vocab_size), distinct_prompts(sizes, vocab_size))


def check_fit(sizes: Sizes, args: argparse.Namespace, window: int) -> None:
    """The longest prompt + --max-tokens within the model's window and --max-model-len; ValueError otherwise."""
    longest = longest_prompt(sizes, args.max_tokens) + args.max_tokens
    for name, limit in (("the model's max_position_embeddings", window), ("--max-model-len", args.max_model_len)):
        if limit is not None and longest > limit:
            raise ValueError(f"--doc-len / --turns / --question-len / --max-tokens: the last chat turn may take "
                             f"{longest} tokens with its answer, over {name} {limit}")


def size_kv_cache(args: argparse.Namespace, sizes: Sizes, concurrency: int) -> None:
    """--num-kv-pages for the servers started here: `serve`'s default, or enough to keep every document and
    conversation cached at once (shared_prefix.kv_pages), unless the KV cache size was given."""
    from cluster.config import MAX_SPECULATIVE_STEPS
    from cluster.engine_limits import DEFAULT_NUM_KV_PAGES

    if args.url is None and args.num_kv_pages is None and args.kv_cache_memory_gib is None:
        needed = kv_pages(sizes, args.max_tokens, args.page_size, concurrency, MAX_SPECULATIVE_STEPS)
        args.num_kv_pages = max(DEFAULT_NUM_KV_PAGES, needed)


def answer_encoder(model_dir):
    """text -> token ids with the checkpoint's tokenizer (a chat turn resends the previous answer's text)."""
    from model_workers.checkpoint.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"--model {model_dir}: --workload {WORKLOAD} encodes each chat answer again with the "
                         "checkpoint's tokenizer.json, which it lacks")
    return partial(encode, tokenizer)


async def flush(session, url: str) -> None:
    """Empties the prefix cache of the server at `url`; RuntimeError naming the answers when it will not."""
    answers = []
    for attempt in range(FLUSH_TRIES):
        for route in FLUSH_ROUTES:
            async with session.post(f"{url}{route}") as response:
                if response.status == 200:
                    return
                answers.append(f"{route}: {response.status} {(await response.read())[:200]!r}")
        await asyncio.sleep(0.2 * (attempt + 1))
    raise RuntimeError(f"{url} did not empty its prefix cache ({'; '.join(answers[-2:])}); --workload {WORKLOAD} "
                       "empties the cache-on server before each pass")


class Side:
    """One server under measurement: sends token-id prompts, empties its cache when it has one."""

    def __init__(self, session, name: str, url: str, max_tokens: int):
        self.session, self.name, self.url, self.max_tokens = session, name, url, max_tokens

    def send(self, ids: list[int]):
        return http_request(self.session, self.url, completion_body(ids, self.max_tokens))

    async def start_pass(self) -> None:
        if self.name == "on":
            await flush(self.session, self.url)


async def documents_phase(side: Side, requests: Requests) -> dict:
    await side.start_pass()
    first = await closed_loop(lambda i: side.send(requests.first_questions[i]), len(requests.first_questions), 1)
    later = await closed_loop(lambda i: side.send(requests.later_questions[i]), len(requests.later_questions), 1)
    return documents_summary(first, later)


async def chat_phase(side: Side, requests: Requests, encode) -> dict:
    await side.start_pass()
    return side_summary(*await run_conversations(side.send, requests.conversations, encode))


async def no_sharing_phase(sides: list[Side], prompts: list[list[int]], concurrency: int, rounds: int) -> dict:
    """Rounds alternating the sides (A B, then B A, ...); per side its no_sharing_summary."""
    measured = {side.name: [] for side in sides}
    for round_index in range(rounds):
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            await side.start_pass()
            measured[side.name].append(await closed_loop(lambda i, s=side: s.send(prompts[i]), len(prompts),
                                                         concurrency))
    return {name: no_sharing_summary(runs) for name, runs in measured.items()}


async def measure_sides(urls: dict, headers: dict, args, requests: Requests, encode, concurrency: int) -> dict:
    """Every phase on every side (the order: module docstring); {phase: {side: summary}}."""
    import aiohttp

    most = max(concurrency, len(requests.conversations))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=most), headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=1200), read_bufsize=1 << 20,
                                     trust_env=False) as session:
        sides = [Side(session, name, url, args.max_tokens) for name, url in urls.items()]
        for side in sides:
            for i in range(args.warmup):
                await side.send(requests.no_sharing[i % len(requests.no_sharing)])
        phases = {"documents": {}, "chat": {}}
        for side in sides:
            phases["documents"][side.name] = await documents_phase(side, requests)
        for side in sides:
            phases["chat"][side.name] = await chat_phase(side, requests, encode)
        phases["no_sharing"] = await no_sharing_phase(sides, requests.no_sharing, concurrency,
                                                      args.throughput_rounds)
        return phases


def start_sides(settings, direct_ingress: bool) -> dict[str, str]:
    """Both servers on the Serve of this Ray: {side: URL}."""
    from cluster.serve_app import APP_NAME
    from model_workers.comm import free_port

    fields = type(settings).model_fields
    if "enable_prefix_caching" not in fields:
        raise ValueError(f"--workload {WORKLOAD}: this server has no prefix cache setting (enable_prefix_caching)")
    if not getattr(settings, "prefix_caching_enabled", settings.enable_prefix_caching):
        raise ValueError(f"--workload {WORKLOAD} starts a server with the prefix cache and one without; leave out "
                         "--disable-radix-cache / --no-enable-prefix-caching")
    proxy_port = start_proxy()
    urls = {}
    for side in SIDES:
        update = {"enable_prefix_caching": side == "on"}
        if "disable_radix_cache" in fields:  # SGLang's spelling of the same setting
            update["disable_radix_cache"] = side == "off"
        if direct_ingress:
            update.update(direct_ingress_port=free_port(), direct_ingress_host="127.0.0.1")
        urls[side] = start_app(settings.model_copy(update=update), proxy_port, f"{APP_NAME}-cache-{side}",
                               f"/cache-{side}")
    return urls


def measure(args, settings, cp, model_dir, requests: Requests, encode, concurrency: int) -> tuple[dict, dict]:
    """(phases, {side: URL}): against --url / --off-url, or two servers started here on a Ray started here."""
    from cluster.launch import engine_cpus, start_ray

    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # per server: its engine's CPUs and one for its HTTP replica (Serve's default for a replica)
    started_ray = args.url is None and start_ray(len(SIDES) * (engine_cpus(cp.cp_size) + 1), args.ray_address)
    if args.url is None and not started_ray:
        raise ValueError("--url is required on a Ray cluster this command joins (--ray-address, $RAY_ADDRESS): "
                         "it starts its own servers only on a Ray it starts")
    try:
        if args.url is None:
            urls = start_sides(settings, args.direct_ingress)
        else:
            urls = {"on": args.url.rstrip("/"), **({"off": args.off_url.rstrip("/")} if args.off_url else {})}
        for side, url in urls.items():
            if model_dir.name not in served_models(url, headers):
                raise ValueError(f"the cache-{side} server at {url} does not serve {model_dir.name!r}: pass the "
                                 "--model it runs")
        return asyncio.run(measure_sides(urls, headers, args, requests, encode, concurrency)), urls
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def build_result(args, model_dir, cp, sizes: Sizes, urls: dict, phases: dict) -> dict:
    values, targets = ratios_and_targets(phases)
    started_here = args.url is None
    sides = {side: {"url": None if started_here else url, "enable_prefix_caching": side == "on"}
             for side, url in urls.items()}
    return {
        "bench": "serve", "workload": WORKLOAD, "command": spelled_command("serve", args, RESULT_FLAGS,
                                                                         NEGATABLE_FLAGS),
        "model": str(model_dir), "model_fingerprint": model_fingerprint(model_dir),
        "dtype": args.dtype, "device": args.device, "max_tokens": args.max_tokens,
        "concurrency": int(args.concurrency), "sizes": asdict(sizes), "machine": machine(),
        "server": {**server_info(args, cp), "num_kv_pages": args.num_kv_pages, "sides": sides},
        "definitions": DEFINITIONS, "phases": phases, "ratios": values, "targets": targets,
    }


def run_shared_prefix(args: argparse.Namespace, levels: list[int]) -> int:
    """The workload, start to end (after serve.py `check_arguments`); prints the result."""
    from cluster.commands.serve import app_args
    from cluster.config import resolve_cp_settings
    from model_workers.checkpoint.model_dir import read_model_spec

    (concurrency,) = levels
    model = read_model_spec(args.model)
    sizes = Sizes.from_args(args, args.num_prompts or max(MIN_REQUESTS_PER_LEVEL, 4 * concurrency))
    check_fit(sizes, args, model.config.max_position_embeddings)
    size_kv_cache(args, sizes, concurrency)
    settings = app_args(args)
    cp = resolve_cp_settings(settings, model)
    encode = answer_encoder(model.path)
    requests = build_requests(sizes, model.config.vocab_size)
    phases, urls = measure(args, settings, cp, model.path, requests, encode, concurrency)
    result = build_result(args, model.path, cp, sizes, urls, phases)
    print_result(json.dumps(result) if args.json else summary_text(result))
    if args.plot:
        plot(result, args.plot)
    return 0
