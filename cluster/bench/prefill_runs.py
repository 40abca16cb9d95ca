"""Timed prefills for `bench prefill`, through the engine `serve` runs: one prompt, one output token.

A request's prefill may take several engine steps (chunks of `prefill_token_budget` tokens, as served); a step
observer collects every rank's `StepResult` of the steps that carried the request, and the per-rank numbers
are their sums (peak RSS: the maximum; for a worker in this process, this process's). `run_configs` launches the
groups (Ray actors, or at C = 1 one worker in this process, without Ray) and times them in turns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from cluster.engine_limits import prefill_chunk_tokens
from cluster.engine_setup import collect, engine_over_workers
from cluster.engine_spec import resolve_engine_spec
from cp_router.cp.balance import max_over_mean
from cp_router.plans import StepResult
from cp_router.protocol import EngineRequest
from model_workers.phase_clock import PHASES as PHASE_NAMES


@dataclass
class PrefillRecord:
    """The steps that prefilled one request, per rank."""

    request_id: str
    chunks: int = 0
    cp_size_used: int = 1
    per_rank: dict[int, list[StepResult]] = field(default_factory=dict)

    def observe(self, step, results: list[StepResult]) -> None:
        if step.prefill is None or all(p.request_id != self.request_id for p in step.prefill.pieces):
            return
        self.chunks += 1
        self.cp_size_used = max(self.cp_size_used, len(step.prefill.ranks) if step.prefill.cp else 1)
        for result in results:
            shard = step.plans[result.cp_rank].prefill
            if shard is not None and any(r.request_id == self.request_id for r in shard.requests):
                self.per_rank.setdefault(result.cp_rank, []).append(result)

    def summary(self, wall_s: float) -> dict:
        ranks = [self.per_rank[r] for r in sorted(self.per_rank)]
        compute = [sum(r.compute_s for r in steps) for steps in ranks]
        return {
            "cp_size_used": self.cp_size_used, "chunks": self.chunks, "wall_s": wall_s, "per_rank_compute_s": compute,
            "per_rank_comm_s": [sum(r.comm_s for r in steps) for steps in ranks],
            "per_rank_cpu_s": [sum(r.cpu_s for r in steps) for steps in ranks],
            "compute_imbalance_max_over_mean": max_over_mean(compute),
            "per_rank_phase_s": [{p: sum(r.prefill_phase_s.get(p, 0.0) for r in steps) for p in PHASE_NAMES}
                                 for steps in ranks],
            "kv_comm_bytes_per_rank": [sum(r.kv_comm_bytes for r in steps) for steps in ranks],
            "comm_bytes_per_rank": [sum(r.comm_bytes for r in steps) for steps in ranks],
            "peak_rss_bytes_per_rank": [max(r.peak_rss_bytes for r in steps) for steps in ranks],
        }


async def _prefill_once(engine, prompt: list[int], request_id: str) -> dict:
    record = PrefillRecord(request_id)
    engine.add_step_observer(record.observe)
    try:
        start = time.perf_counter()
        await collect(engine, EngineRequest(request_id, tuple(prompt), 1, temperature=0.0, ignore_eos=True))
        wall_s = time.perf_counter() - start
        await engine.drain()  # the owner drops the finished request's state before the next run
    finally:
        engine.step_observers.remove(record.observe)
    return record.summary(wall_s)


def time_prefills(engine, prompt: list[int], repeats: int, tag: str) -> dict:
    """Median (by wall time) of `repeats` prefills of one prompt; the per-rank numbers of that run."""
    return median_run([asyncio.run(_prefill_once(engine, prompt, f"{tag}-{i}")) for i in range(repeats)])


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]


def interleaved_prefills(model_dir, configs: list[tuple], prompts: dict[int, list[int]], repeats: int,
                         paths: tuple[str, ...] = ("served", "one_batch")) -> list[dict[str, dict[int, dict]]]:
    """Per config (cp, workers, EngineOptions), per path of `paths` ("served": chunks of `prefill_chunk_tokens`, as
    served; "one_batch": the whole prompt in one step), per length: the `median_run` of `repeats` prefills. After an
    untimed warm-up of each path, the configs take turns: every prefill of one config is followed by the same
    prefill on the next."""
    longest = max(prompts)
    out: list[dict[str, dict[int, dict]]] = [{} for _ in configs]
    for path in paths:
        engines = []
        for cp, workers, options in configs:
            served = prefill_chunk_tokens(options.prefill_token_budget, cp.cp_size)
            budget = served if path == "served" else max(longest, served)
            spec = resolve_engine_spec(model_dir, cp, replace(options, prefill_token_budget=budget))
            engines.append(engine_over_workers(spec, workers))
            time_prefills(engines[-1], next(iter(prompts.values()))[:256], 1, f"{path}-warm")
        for n, prompt in prompts.items():
            runs: list[list[dict]] = [[] for _ in configs]
            for i in range(repeats):
                for config_runs, engine in zip(runs, engines):
                    config_runs.append(asyncio.run(_prefill_once(engine, prompt, f"{path}-{n}-{i}")))
            for timed, config_runs in zip(out, runs):
                timed.setdefault(path, {})[n] = median_run(config_runs)
    return out


@dataclass
class Launched:
    """One config's rank workers (Ray actors of a CP group, or one worker in this process) and its options."""

    workers: list
    options: object  # EngineOptions
    kv_bytes_per_token: Callable[[], int]
    shutdown: Callable[[], None]


def run_configs(model_dir, configs: list[tuple], prompts: dict[int, list[int]], args, repeats: int,
                paths: tuple[str, ...] = ("served", "one_batch"), in_process: bool = False) -> list[dict]:
    """Each config (cp, threads: a CP group of C ranks, `threads` each) launched once, then every length prefilled
    on each of `paths`, shortest first, the configs taking turns (`interleaved_prefills`). One dict per config.
    `args` gives dtype, device, kv_cache_dtype and enable_deterministic_inference (`bench prefill`'s flags).
    `in_process`: C = 1 configs as workers in this process (no Ray); else Ray actors on the Ray already up."""
    launched: list[tuple] = []
    try:
        for cp, threads in configs:
            launched.append((cp, threads, launch_config(model_dir, cp, threads, prompts, args, in_process)))
        timed = interleaved_prefills(model_dir, [(cp, group.workers, group.options) for cp, _, group in launched],
                                     prompts, repeats, paths)
        return [{"threads_per_rank": threads, "cp_size": cp.cp_size, "paths": paths_timed,
                 "kv_bytes_per_token": group.kv_bytes_per_token(),
                 "prefill_chunk_tokens": prefill_chunk_tokens(group.options.prefill_token_budget, cp.cp_size)}
                for (cp, threads, group), paths_timed in zip(launched, timed)]
    finally:
        for _, _, group in launched:
            group.shutdown()


def launch_config(model_dir, cp, threads: int, prompts: dict[int, list[int]], args, in_process: bool) -> Launched:
    """One config's workers and EngineOptions, the cache sized for the longest prompt."""
    from cluster.engine_spec import EngineOptions
    from cp_router.cp.padding import ceil_div

    # speculation on (k = 1, which a one-token request never uses): the MTP layer is prefilled, as the FLOP count has it
    options = EngineOptions(args.dtype, num_pages=ceil_div(max(prompts), 64) + 2, page_size=64, num_speculative_steps=1,
                            threads_per_worker=threads, use_gpu=str(args.device).startswith("cuda"),
                            kv_cache_dtype=args.kv_cache_dtype, deterministic=args.enable_deterministic_inference,
                            time_prefill_phases=True, attention_backend=args.attention_backend,
                            enable_prefix_caching=False)  # repeats of one prompt must prefill it all again
    if in_process:
        return local_config(model_dir, cp, threads, options)
    import ray

    from cluster.launch import launch_group

    group = launch_group(model_dir, cp, options.dtype, options.num_pages, options.page_size,
                         threads_per_worker=threads, use_gpu=options.use_gpu, kv_cache_dtype=args.kv_cache_dtype,
                         deterministic=options.deterministic)
    return Launched(group.workers, options, lambda: ray.get(group.workers[0].kv_bytes_per_token.remote()),
                    group.shutdown)


def local_config(model_dir, cp, threads: int, options) -> Launched:
    """A C = 1 config as a worker in this process, computing on `threads` torch threads."""
    import torch

    from cluster.local_worker import InProcessWorker

    if cp.cp_size != 1:
        raise ValueError(f"a worker in this process is one rank, not a CP group of {cp.cp_size}")
    torch.set_num_threads(threads)
    worker = InProcessWorker(resolve_engine_spec(model_dir, cp, options).rank)
    return Launched([worker], options, worker.worker.kv_bytes_per_token, lambda: None)
