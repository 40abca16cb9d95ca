"""The measurements of `dsa-serve bench pd` (cluster/bench/pd.py)."""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import time

import torch

from cluster.config import ResolvedCPConfig
from cluster.engine_spec import LOCAL_CP, EngineOptions
from cp_router.disaggregated import DisaggregatedEngine
from cp_router.handoff import HandoffTicket
from cp_router.pages import pages_for
from cp_router.protocol import EngineRequest

PAGE_SIZE = 64


def options(args: argparse.Namespace) -> EngineOptions:
    longest = max(args.long_len, args.transfer_len, args.alone_len) + 512
    pages = (2 * pages_for(longest, PAGE_SIZE) + args.streams * pages_for(args.stream_tokens + 128, PAGE_SIZE)) + 64
    return EngineOptions(dtype="bfloat16", num_pages=pages, page_size=PAGE_SIZE,
                         num_speculative_steps=args.speculative_num_steps, enable_prefix_caching=False,
                         max_model_len=longest + 256)


def cp_of(size: int) -> ResolvedCPConfig:
    return LOCAL_CP if size == 1 else ResolvedCPConfig(True, size, "interleave", "v2")


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, 6000, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def measure(model_dir, args: argparse.Namespace) -> dict:
    from cluster.launch import engine_cpus, start_ray
    from cluster.ray_engine import start_engine

    started = start_ray(engine_cpus(args.cp_size) + engine_cpus(args.prefill_cp_size) + engine_cpus(1))
    opts = options(args)
    colocated, groups = start_engine(model_dir, cp_of(args.cp_size), opts)
    prefill, prefill_group = start_engine(model_dir, cp_of(args.prefill_cp_size), opts)
    decode, decode_group = start_engine(model_dir, LOCAL_CP, opts)
    pd = DisaggregatedEngine(decode, prefill)
    try:
        return asyncio.run(all_measurements(colocated, pd, args))
    finally:
        for group in (groups, prefill_group, decode_group):
            group.shutdown()
        if started:
            import ray

            ray.shutdown()


async def all_measurements(colocated, pd: DisaggregatedEngine, args: argparse.Namespace) -> dict:
    await one(pd, EngineRequest("warm-pd", prompt(256, 1), 4, temperature=0.0, ignore_eos=True))
    await one(colocated, EngineRequest("warm-co", prompt(256, 1), 4, temperature=0.0, ignore_eos=True))
    isolation = {"colocated": await isolation_run(colocated, args, "co"), "pd": await isolation_run(pd, args, "pd")}
    transfer = await transfer_run(colocated, pd, args)
    alone = await alone_runs(colocated, pd, args)
    ratios = {"isolation_itl_p99_ratio": round(isolation["pd"]["itl_p99_s"] / isolation["colocated"]["itl_p99_s"], 4),
              "transfer_over_prefill": transfer["transfer_over_prefill"],
              "alone_ttft_ratio": round(alone["colocated"]["ttft_s"] / alone["pd"]["ttft_s"], 4),
              "alone_tokens_per_s_ratio": round(alone["pd"]["tokens_per_s"] / alone["colocated"]["tokens_per_s"], 4)}
    return {"isolation": isolation, "transfer": transfer, "alone": alone, "ratios": ratios,
            "definitions": {"alone_ttft_ratio": "colocated TTFT / PD TTFT (>= 0.8: PD's TTFT at most 1.25x)",
                            "isolation_itl_p99_ratio": "PD p99 / colocated p99 of the short streams' chunk gaps"}}


async def one(engine, request: EngineRequest) -> dict:
    """Arrival times of each chunk (seconds from the call), tokens."""
    start, times, tokens = time.perf_counter(), [], 0
    async for chunk in engine.generate(request):
        if chunk.token_ids:
            times.append(time.perf_counter() - start)
            tokens += len(chunk.token_ids)
    return {"times": times, "tokens": tokens}


async def isolation_run(engine, args: argparse.Namespace, tag: str) -> dict:
    """Short streams renewed until every long prompt has its first token; their chunk gaps meanwhile."""
    done, gaps = asyncio.Event(), []

    async def short_stream(index: int) -> None:
        round_ = 0
        while not done.is_set():
            request = EngineRequest(f"{tag}-s{index}-{round_}", prompt(32, 100 + index), args.stream_tokens,
                                    temperature=0.0, ignore_eos=True)
            times = (await one(engine, request))["times"]
            gaps.extend(b - a for a, b in zip(times, times[1:]))
            round_ += 1

    async def long_prompts() -> list[float]:
        await asyncio.sleep(1.0)  # the short streams are decoding
        ttfts = []
        for i in range(args.long_prompts):
            request = EngineRequest(f"{tag}-long{i}", prompt(args.long_len, 500 + i), 2, temperature=0.0,
                                    ignore_eos=True)
            ttfts.append((await one(engine, request))["times"][0])
        done.set()
        return ttfts

    streams = [asyncio.create_task(short_stream(i)) for i in range(args.streams)]
    ttfts = await long_prompts()
    await asyncio.gather(*streams)
    gaps.sort()
    return {"chunk_gaps": len(gaps), "itl_p50_s": round(statistics.median(gaps), 5),
            "itl_p99_s": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 5),
            "itl_max_s": round(gaps[-1], 4), "long_prompt_ttft_s": [round(t, 3) for t in ttfts]}


async def transfer_run(colocated, pd: DisaggregatedEngine, args: argparse.Namespace) -> dict:
    """One long prompt handed off: bytes, the ranks' read-out / write time, two serialization hops."""
    clocks = {"prefill": 0.0, "decode": 0.0}
    pd.prefill.add_step_observer(lambda step, results: clocks.__setitem__(
        "prefill", clocks["prefill"] + max(r.handoff_s for r in results)))
    pd.decode.add_step_observer(lambda step, results: clocks.__setitem__(
        "decode", clocks["decode"] + max(r.handoff_s for r in results)))
    request = EngineRequest("transfer", prompt(args.transfer_len, 7), 4, temperature=0.0, ignore_eos=True)
    prefill_s = (await one(colocated, EngineRequest("transfer-co", request.prompt_token_ids, 1, temperature=0.0,
                                                    ignore_eos=True)))["times"][0]
    tickets = [item async for item in pd.prefill.prefill_handoff(request) if isinstance(item, HandoffTicket)]
    handoff = tickets[0].handoff
    start = time.perf_counter()
    for _ in range(2):  # rank -> engine, engine -> rank
        pickle.loads(pickle.dumps(handoff, protocol=5))
    serialize_s = time.perf_counter() - start
    await one(pd, request)  # the same request end to end: the decode rank writes its hand-off
    bytes_per_token = await pd.decode.workers[0].kv_bytes_per_token.remote()
    transfer_s = clocks["prefill"] / 2 + clocks["decode"] + serialize_s  # the prefill side read out twice
    return {"prompt_tokens": args.transfer_len, "bytes": handoff.nbytes,
            "formula_bytes": pages_for(args.transfer_len, PAGE_SIZE) * PAGE_SIZE * bytes_per_token,
            "read_out_s": round(clocks["prefill"] / 2, 5), "write_s": round(clocks["decode"], 5),
            "serialize_two_hops_s": round(serialize_s, 5), "transfer_s": round(transfer_s, 5),
            "prefill_s": round(prefill_s, 4), "transfer_over_prefill": round(transfer_s / prefill_s, 4)}


async def alone_runs(colocated, pd: DisaggregatedEngine, args: argparse.Namespace) -> dict:
    runs = {"colocated": [], "pd": []}
    for repeat in range(args.repeats):
        order = (("colocated", colocated), ("pd", pd)) if repeat % 2 == 0 else (("pd", pd), ("colocated", colocated))
        for name, engine in order:
            request = EngineRequest(f"alone-{name}-{repeat}", prompt(args.alone_len, 900 + repeat),
                                    args.alone_tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            times = (await one(engine, request))["times"]
            runs[name].append((times[0], args.alone_tokens / (time.perf_counter() - start)))
    return {name: {"ttft_s": round(statistics.median(t for t, _ in values), 4),
                   "tokens_per_s": round(statistics.median(r for _, r in values), 2),
                   "runs": [[round(t, 4), round(r, 2)] for t, r in values]} for name, values in runs.items()}
