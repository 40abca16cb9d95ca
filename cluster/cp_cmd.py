"""`dsa-serve generate` through the engine (in-process, or a CP group on Ray) and the CP sessions commands share.

`engine_session` starts (or joins) Ray, launches one CP engine and always tears both down again.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import ray

from cluster.config import ResolvedCPConfig
from cluster.cp_args import resolve_cp_args
from cluster.generate_cmd import parse_prompt_ids
from cluster.launch import CPEngine, engine_cpus, launch_engine, start_ray
from cluster.engine_launch import EngineOptions, run_all, start_engine, start_local_engine
from cluster.engine_protocol import EngineRequest
from cp_router.padding import ceil_div
from model_workers.model.config import load_model_config
from model_workers.tokenizer import encode, load_tokenizer

PAGE_SIZE = 64


@contextlib.contextmanager
def ray_session(min_cpus: int, address: str | None):
    """Ray for the command: joined at `address` or started locally (and then shut down on exit)."""
    started = start_ray(min_cpus, address)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def engine_session(model_dir: Path, cp: ResolvedCPConfig, args: argparse.Namespace, num_pages: int):
    """One CP engine for the command (Ray started if needed); always shut down on exit."""
    with ray_session(engine_cpus(cp.cp_size), args.ray_address):
        use_gpu = str(args.device).startswith("cuda")
        engine: CPEngine = launch_engine(model_dir, cp, args.dtype, num_pages, PAGE_SIZE, use_gpu=use_gpu)
        try:
            yield engine
        finally:
            engine.shutdown()


def read_prompts(args: argparse.Namespace, model_dir: Path, vocab_size: int) -> list[list[int]]:
    """--prompt texts (tokenized) or --prompt-ids lists, each checked against the vocabulary."""
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


def run_generate(args: argparse.Namespace, model_dir: Path) -> list[dict]:
    """Prompts -> results through the engine: in this process (C = 1), or CP prefill across Ray ranks."""
    cp = resolve_cp_args(args, model_dir) if args.cp_size is not None else None
    config = load_model_config(model_dir)
    requests = cli_requests(args, read_prompts(args, model_dir, config.vocab_size))
    k = args.speculative_num_steps
    num_pages = sum(ceil_div(len(r.prompt_token_ids) + r.max_tokens + k + 1, PAGE_SIZE) for r in requests) + 1
    options = EngineOptions(args.dtype, num_pages, PAGE_SIZE, k, use_gpu=str(args.device).startswith("cuda"))
    if cp is None:
        return run_all(start_local_engine(model_dir, options), requests)
    with ray_session(engine_cpus(cp.cp_size), args.ray_address):
        engine, group = start_engine(model_dir, cp, options)
        try:
            results = run_all(engine, requests)
        finally:
            group.shutdown()
    for result in results:
        result.update(cp_size=cp.cp_size, cp_strategy=cp.strategy, cp_impl=cp.impl)
    return results
