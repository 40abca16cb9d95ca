"""`dsa-serve generate --cp-size C` through Ray, and the engine session the CP sub-commands share.

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
from cp_router.padding import ceil_div
from cp_router.plans import SamplingParams
from model_workers.model.config import load_model_config
from model_workers.tokenizer import decode, encode, load_tokenizer

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


def run_generate_cp(args: argparse.Namespace, model_dir: Path) -> dict:
    """Prompt -> tokens through the CP engine: CP prefill across the ranks, decode on the owner."""
    cp = resolve_cp_args(args, model_dir)
    config, tokenizer = load_model_config(model_dir), load_tokenizer(model_dir)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs {model_dir / 'tokenizer.json'}; use --prompt-ids instead")
        prompt_ids = encode(tokenizer, args.prompt)
    else:
        prompt_ids = parse_prompt_ids(args.prompt_ids)
    bad = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    num_pages = ceil_div(len(prompt_ids) + args.max_tokens, PAGE_SIZE) + 1
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    with engine_session(model_dir, cp, args, num_pages) as engine:
        call = engine.router.generate.remote([prompt_ids], args.max_tokens, sampling, config.eos_token_ids)
        (result,) = ray.get(call)
    result.update(cp_size=cp.cp_size, cp_strategy=cp.strategy, cp_impl=cp.impl)
    if tokenizer is not None:
        result["text"] = decode(tokenizer, result["token_ids"])
    return result
