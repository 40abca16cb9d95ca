"""Disaggregation under failures (engines in this process, deterministic inference): a prefill group that fails
before its hand-off is retried on another group and the stream is bit-identical to a colocated run; a hand-off that
never comes is tried once more, then the request ends with an error naming both attempts, nothing streamed; a decode
rank lost mid-stream is replaced and its requests resume where they stopped (re-prefilled in the decode group, the
streamed token kept). No page stays taken on either side."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine_spec import LOCAL_CP, EngineOptions, resolve_engine_spec
from cluster.local_worker import InProcessWorker
from cp_router.disaggregated import DisaggregatedEngine
from cp_router.handoff import HandoffTicket
from cp_router.protocol import EngineRequest, EngineUnavailableError
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine
from test_pd_engine import outcomes, outcomes_of, prompt

MODEL = resolve_model_dir(None)
OPTIONS = EngineOptions(dtype="bfloat16", num_pages=48, page_size=32, deterministic=True, num_speculative_steps=2)
REQUESTS = [EngineRequest(f"f{i}", prompt(40 + 70 * i, 50 + i), 20, temperature=0.0 if i % 2 else 0.7, seed=i,
                          ignore_eos=True, logprobs=1) for i in range(4)]


@pytest.fixture(scope="module")
def colocated():
    return outcomes(local_engine(MODEL, OPTIONS), REQUESTS)


class Groups:
    """A prefill client over several prefill engines: attempt n goes to group min(n, last), as Serve's router may
    send a retry to another replica."""

    def __init__(self, *groups):
        self.groups, self.calls = groups, 0

    def prefill_handoff(self, request):
        group = self.groups[min(self.calls, len(self.groups) - 1)]
        self.calls += 1
        return group.prefill_handoff(request)

    async def abort(self, request_id):
        for group in self.groups:
            await group.abort(request_id)


def settled(workload, *engines):
    """`workload`'s result, once every engine has also run its frees (one event loop for both)."""
    async def main():
        result = await workload
        for engine in engines:
            await engine.drain()
        return result

    return asyncio.run(main())


def assert_no_pages_taken(*engines):
    for engine in engines:
        assert engine.scheduler.free_pages() == [OPTIONS.num_pages] and not engine.scheduler.requests
        assert engine.workers[0].worker.held == {}


def test_a_prefill_group_failing_before_the_handoff_is_retried_on_another(colocated):
    broken, healthy, decode = (local_engine(MODEL, OPTIONS) for _ in range(3))
    worker = broken.workers[0].worker

    def dies(plan):
        raise RuntimeError("cp_rank 0 failed the step: the node went away")

    worker.step = dies
    pd = DisaggregatedEngine(decode, Groups(broken, healthy))
    assert settled(outcomes_of(pd, REQUESTS[:1]), broken, healthy, decode) == {"f0": colocated["f0"]}
    assert pd.stats["prefill_retries"] == 1 and pd.stats["handoffs"] == 1
    del worker.step
    assert_no_pages_taken(broken, healthy, decode)


class LostHandoff:
    """A prefill engine whose hand-off never arrives (a transfer that hangs after the first chunk)."""

    def __init__(self, engine):
        self.engine = engine

    async def prefill_handoff(self, request):
        async for item in self.engine.prefill_handoff(request):
            if isinstance(item, HandoffTicket):
                await asyncio.sleep(3600)
            yield item

    async def abort(self, request_id):
        await self.engine.abort(request_id)


def test_a_handoff_that_never_comes_is_retried_once_then_a_clear_error(colocated):
    prefill, decode = local_engine(MODEL, OPTIONS), local_engine(MODEL, OPTIONS)
    pd = DisaggregatedEngine(decode, LostHandoff(prefill), handoff_timeout_s=0.5)
    tokens, error = settled(first_failure(pd, REQUESTS[1]), prefill, decode)
    assert tokens == [] and isinstance(error, EngineUnavailableError)
    assert "no prefill group handed it off" in str(error) and str(error).count("TimeoutError") == 2
    assert pd.stats["prefill_retries"] == 1 and pd.stats["handoffs"] == 0
    assert_no_pages_taken(prefill, decode)


async def first_failure(engine, request) -> tuple[list[int], Exception | None]:
    """The tokens streamed, and the error the stream ended with (None: it finished)."""
    tokens = []
    try:
        async for chunk in engine.generate(request):
            tokens += chunk.token_ids
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return tokens, exc
    return tokens, None


class ReplaceLost:
    """GroupRepair of an in-process group: the rank `kill` marked lost is replaced by a freshly loaded worker."""

    def __init__(self):
        self.lost, self.replaced = False, 0

    async def lost_ranks(self, workers):
        return [0] if self.lost else []

    async def replace(self, workers, lost):
        self.lost, self.replaced = False, self.replaced + 1
        return [InProcessWorker(resolve_engine_spec(MODEL, LOCAL_CP, OPTIONS).rank)]


def test_a_decode_rank_lost_mid_stream_resumes_every_request_bit_exact(colocated):
    prefill, decode = local_engine(MODEL, OPTIONS), local_engine(MODEL, OPTIONS)
    decode.repair = repair = ReplaceLost()
    steps = {"decode": 0}

    def observer(step, results):
        steps["decode"] += bool(step.decode_ids)
        if steps["decode"] == 1 and not repair.replaced:  # the rank dies before its next step
            repair.lost = True
            decode.workers[0].worker.step = dies

    def dies(plan):
        raise RuntimeError("cp_rank 0 left the step: its process died")

    decode.add_step_observer(observer)
    pd = DisaggregatedEngine(decode, prefill)
    assert settled(outcomes_of(pd, REQUESTS), prefill, decode) == colocated
    assert repair.replaced == 1 and decode.recoveries[-1].resumed >= 1
    assert_no_pages_taken(prefill, decode)


def test_a_reader_leaving_after_the_first_chunk_frees_the_reservation():
    prefill, decode = local_engine(MODEL, OPTIONS), local_engine(MODEL, OPTIONS)
    pd = DisaggregatedEngine(decode, prefill)

    async def first_chunk_only():
        stream = pd.generate(REQUESTS[2])
        chunk = await stream.__anext__()
        await stream.aclose()  # the client went away
        return chunk.token_ids

    assert len(settled(first_chunk_only(), prefill, decode)) >= 1
    assert_no_pages_taken(prefill, decode)
