"""A rank process killed (SIGKILL) mid-stream: the engine replaces it in its bundle, re-forms the CP group and
resumes every request by prefilling its prompt plus the tokens it already streamed. Under
--enable-deterministic-inference the streams equal an undisturbed run bit for bit (tokens and logprobs), greedy
and seeded sampling alike; a group that cannot be rebuilt ends every stream with an error naming the cause.
One C = 2 group on local Ray (gloo), the default model in bf16, for the module."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import engine_cpus, launch_group, start_ray
from cluster.rank_repair import RayRankRepair
from cp_router.protocol import EngineRequest, EngineUnavailableError
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.streams import act_after_steps, outcomes

MODEL = resolve_model_dir(None)
CP = ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="legacy")
DTYPE, NUM_PAGES, PAGE_SIZE, VOCAB = "bfloat16", 64, 64, 6144


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


# 8 streams: 4 greedy, 4 seeded sampling; prompts of 24..500 tokens (CP-split and one-rank prefills)
REQUESTS = [EngineRequest(f"r{i}", prompt(24 + 68 * i, i), 40, temperature=0.0 if i % 2 == 0 else 0.8,
                          top_p=1.0 if i % 2 == 0 else 0.95, seed=1000 + i, ignore_eos=True, logprobs=2)
            for i in range(8)]


@pytest.fixture(scope="module")
def group():
    start_ray(min_cpus=engine_cpus(CP.cp_size))
    launched = launch_group(MODEL, CP, DTYPE, NUM_PAGES, PAGE_SIZE, deterministic=True)
    yield launched
    launched.shutdown()
    ray.shutdown()


def engine_for(group, prefill_token_budget: int = 512, repair: RayRankRepair | None = None, k: int = 0):
    options = EngineOptions(dtype=DTYPE, num_pages=NUM_PAGES, page_size=PAGE_SIZE, deterministic=True,
                            prefill_token_budget=prefill_token_budget, num_speculative_steps=k)
    return engine_over_workers(resolve_engine_spec(MODEL, CP, options), group.workers,
                               repair=repair or RayRankRepair(group.launch))


def pid_of(worker) -> int:
    return ray.get(worker.__ray_call__.remote(lambda _self: os.getpid()))


def kill_after_steps(engine, worker, steps: int, delay_s: float = 0.0) -> list[int]:
    """SIGKILLs `worker`'s process once, `delay_s` after the engine's `steps`-th step; the list gets its pid."""
    pid = pid_of(worker)
    return act_after_steps(engine, steps, lambda: (os.kill(pid, signal.SIGKILL), pid)[1], delay_s)


def assert_idle(engine, group) -> None:
    assert engine.free_pages == [NUM_PAGES] * CP.cp_size
    asyncio.run(engine.drain())  # the ranks' frees wait for a next request's step; drain sends them now
    assert ray.get([w.held_requests.remote() for w in group.workers]) == [[], []]


@pytest.fixture(scope="module")
def undisturbed(group):
    return outcomes(engine_for(group), REQUESTS)


def test_every_request_finishes_undisturbed(undisturbed):
    assert all(finish == "length" and len(tokens) == 40 for tokens, _, finish in undisturbed.values())


def test_with_mtp_speculation_the_resumed_streams_are_bit_exact_too(group):
    """k = 2, seeded sampling included: the recompute takes the last streamed token as the pending one (no new
    sample), so the next step drafts and verifies exactly as the undisturbed run did."""
    requests = REQUESTS[:4]
    reference = outcomes(engine_for(group, k=2), requests)
    engine = engine_for(group, k=2)
    killed = kill_after_steps(engine, group.workers[1], steps=3)
    assert outcomes(engine, requests) == reference
    assert killed and engine.recoveries[-1].ok and engine.recoveries[-1].resumed == 4
    assert_idle(engine, group)


def test_killing_a_rank_between_decode_steps_resumes_all_8_streams_bit_exact(group, undisturbed):
    engine = engine_for(group)
    killed = kill_after_steps(engine, group.workers[1], steps=4)
    assert outcomes(engine, REQUESTS) == undisturbed
    assert killed
    (record,) = engine.recoveries
    assert record.ok and record.lost_ranks == (1,) and record.resumed == 8 and record.failed == 0
    assert pid_of(group.workers[1]) != killed[0]
    assert_idle(engine, group)


def test_killing_the_rendezvous_rank_inside_a_cp_prefill_step_resumes_bit_exact(group, undisturbed):
    """Rank 0 dies while a 256-token prefill chunk runs across both ranks: its peer fails in a collective, the
    step fails on both, and rank 0 (whose address the group meets at) is replaced."""
    engine = engine_for(group, prefill_token_budget=256)
    reference = outcomes(engine, REQUESTS[-2:])
    assert reference == {r.request_id: undisturbed[r.request_id] for r in REQUESTS[-2:]}
    killed = kill_after_steps(engine, group.workers[0], steps=1, delay_s=0.05)
    assert outcomes(engine, REQUESTS[-2:]) == reference
    assert killed and engine.recoveries[-1].lost_ranks == (0,) and engine.recoveries[-1].ok
    assert_idle(engine, group)


def test_a_rank_that_dies_while_idle_is_replaced_by_the_health_check(group):
    engine = engine_for(group)
    pid = pid_of(group.workers[1])
    os.kill(pid, signal.SIGKILL)
    asyncio.run(engine.check_health())  # healthy again: the rank was replaced, not reported
    (record,) = engine.recoveries
    assert record.ok and record.lost_ranks == (1,) and (record.resumed, record.failed) == (0, 0)
    assert "health check" in record.cause and pid_of(group.workers[1]) != pid
    assert ray.get([w.ping.remote() for w in group.workers]) == [0, 1]


def test_a_request_resumed_max_resumes_times_ends_with_an_error_naming_it(group):
    engine = engine_for(group)
    engine.max_resumes = 0
    kill_after_steps(engine, group.workers[0], steps=2)
    for tokens, _, error in outcomes(engine, REQUESTS[:2]).values():
        assert isinstance(error, EngineUnavailableError) and "lost its ranks 1 times" in str(error)
    assert engine.recoveries[-1].ok and engine.recoveries[-1].failed == 2
    assert_idle(engine, group)


def test_a_group_that_cannot_be_rebuilt_ends_every_stream_with_the_cause(group):
    missing = replace(group.launch.rank.model, path=Path("/nonexistent/checkpoint"))
    broken = RayRankRepair(replace(group.launch, rank=replace(group.launch.rank, model=missing)))
    engine = engine_for(group, repair=broken)
    kill_after_steps(engine, group.workers[1], steps=3)
    results = outcomes(engine, REQUESTS[:3])
    for tokens, _, error in results.values():
        assert isinstance(error, EngineUnavailableError)
        assert "could not be rebuilt after losing cp_rank(s) [1]" in str(error)
    assert not engine.recoveries[-1].ok and engine.recoveries[-1].failed == 3
    assert engine.scheduler.requests == {} and engine.free_pages == [NUM_PAGES] * CP.cp_size
    asyncio.run(RayRankRepair(group.launch).replace(group.workers, [1]))  # whole again for what follows
    assert ray.get([w.ping.remote() for w in group.workers]) == [0, 1]
