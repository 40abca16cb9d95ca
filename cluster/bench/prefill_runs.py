"""Timed prefills for `bench prefill`, through the engine `serve` runs: one prompt, one output token.

A request's prefill may take several engine steps (chunks of `prefill_token_budget` tokens, as served); a step
observer collects every rank's `StepResult` of the steps that carried the request, and the per-rank numbers
are their sums (peak RSS: the maximum).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from cluster.engine_limits import prefill_chunk_tokens
from cluster.engine_setup import collect, engine_over_workers
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
            engines.append(engine_over_workers(model_dir, cp, replace(options, prefill_token_budget=budget), workers))
            time_prefills(engines[-1], next(iter(prompts.values()))[:256], 1, f"{path}-warm")
        for n, prompt in prompts.items():
            runs: list[list[dict]] = [[] for _ in configs]
            for i in range(repeats):
                for config_runs, engine in zip(runs, engines):
                    config_runs.append(asyncio.run(_prefill_once(engine, prompt, f"{path}-{n}-{i}")))
            for timed, config_runs in zip(out, runs):
                timed.setdefault(path, {})[n] = median_run(config_runs)
    return out
