"""The scheduler alone (no model, no Ray): FCFS under token and page budgets, chunking with CP-sized pieces,
owners, lockstep plans, the one page allocator per rank (tables in the plans, frees on abort / final chunk /
rollback), preempt-newest with recompute, the stop rule."""

import pytest

from cp_router.plans import RequestOutput
from cp_router.sampling import SamplingParams
from cp_router.scheduler import Scheduler, SchedulerConfig
from cp_router.scheduler_prefill import chunk_len


def scheduler(num_pages: int = 32, cp_size: int = 2, k: int = 0, budget: int = 16, cp_min: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(cp_size, num_pages, 4, budget, "zigzag", "legacy", k, 4,
                                     cp_min_prefill_tokens=cp_min))


def outputs_for(step, token: int = 7, count: int = 1) -> dict:
    """What the owners would return: `count` tokens for every decoded request and every final prefill piece."""
    ids = list(step.decode_ids)
    if step.prefill is not None:
        ids += [p.request_id for p in step.prefill.pieces if p.final]
    return {rid: RequestOutput(rid, token, token_ids=[token] * count) for rid in ids}


def run_step(s: Scheduler, token: int = 7):
    step = s.schedule()
    count = step.plans[next(iter(step.plans))].num_steps if step.decode_ids else 1
    s.apply(step, outputs_for(step, token, count))
    return step


def test_chunks_leave_a_remainder_of_zero_or_at_least_the_alignment():
    assert chunk_len(40, 16, 4) == 16 and chunk_len(18, 16, 4) == 14 and chunk_len(12, 16, 4) == 12
    assert chunk_len(19, 16, 4) == 15


def test_a_long_prompt_is_prefilled_in_cp_chunks_with_prefix_offsets():
    s = scheduler()
    s.add("long", list(range(1, 41)), SamplingParams(max_tokens=4))
    prefixes = []
    for _ in range(3):
        step = run_step(s)
        shard = step.plans[0].prefill
        assert set(step.plans) == {0, 1} and shard.meta.cp_size == 2  # every chunk runs with CP
        prefixes.append((shard.meta.prefix_lens[0], shard.meta.extend_lens[0], shard.requests[0].final_chunk))
    assert prefixes == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert [len(table) for table in shard.page_tables] == [10]  # 40 tokens / page_size 4, on every rank
    seq = s.requests["long"]
    assert seq.output_ids == [7] and seq.num_cached == 40 and {r: len(p) for r, p in seq.pages.items()} == {0: 10}
    assert s.free_pages() == [32 - 10, 32]  # the final chunk freed the non-owner's copy


def test_owners_are_the_least_loaded_ranks_and_decode_plans_are_per_owner():
    s = scheduler(budget=32)
    for i, n in enumerate([9, 6, 5]):
        s.add(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=3))
    step = run_step(s)
    assert step.prefill.owners == (0, 1, 1)  # r1 and r2 together hold fewer pages than r0
    step = s.schedule()
    assert {r: [i.request_id for i in p.decode] for r, p in step.plans.items()} == {0: ["r0"], 1: ["r1", "r2"]}
    assert all(p.num_steps == 4 for p in step.plans.values())  # nothing waits: several steps per call


def test_a_short_batch_runs_without_cp_on_one_rank():
    s = scheduler()
    s.add("tiny", [1, 2, 3], SamplingParams(max_tokens=2))
    step = run_step(s)
    assert list(step.plans) == [0] and step.plans[0].prefill.meta.cp_size == 1


def test_new_prompts_below_cp_min_prefill_tokens_run_whole_each_on_its_owner():
    s = scheduler(budget=64, cp_min=24)
    s.add("a", list(range(1, 11)), SamplingParams(max_tokens=2))
    s.add("b", list(range(1, 9)), SamplingParams(max_tokens=2))
    step = run_step(s)  # 18 new tokens < 24: each rank prefills the prompt it owns, no collectives
    assert not step.prefill.cp and step.prefill.owners == (0, 1) and step.prefill.ranks == (0, 1)
    for cp_rank, request_id, length in [(0, "a", 10), (1, "b", 8)]:
        shard = step.plans[cp_rank].prefill
        assert shard.meta.cp_size == 1 and [r.request_id for r in shard.requests] == [request_id]
        assert shard.token_ids_local.tolist() == list(range(1, length + 1))
    assert s.free_pages() == [32 - 3, 32 - 2]  # pages on the owner only
    s.add("c", list(range(101, 125)), SamplingParams(max_tokens=2))  # shares no prefix with a or b
    step = s.schedule()  # 24 new tokens: across the group
    assert step.prefill.cp and set(step.plans) == {0, 1} and step.plans[0].prefill.meta.cp_size == 2


def test_every_chunk_of_a_chunked_prompt_runs_across_the_group_whatever_its_size():
    s = scheduler(budget=16, cp_min=1000)
    s.add("long", list(range(1, 41)), SamplingParams(max_tokens=2))
    for expected in [(0, 16), (16, 16), (32, 8)]:  # the last chunk (8 tokens) too: both ranks hold the prefix
        step = run_step(s)
        meta = step.plans[0].prefill.meta
        assert set(step.plans) == {0, 1} and (meta.prefix_lens[0], meta.extend_lens[0]) == expected
    s.add("short", list(range(101, 117)), SamplingParams(max_tokens=2))  # no prefix cached
    step = s.schedule()  # a whole 16-token prompt alone: on the least loaded rank
    assert not step.prefill.cp and step.prefill.ranks == (1,) and step.plans[1].prefill.meta.cp_size == 1


def test_admission_waits_for_pages_and_keeps_fcfs():
    s = scheduler(num_pages=6)
    s.add("a", list(range(1, 17)), SamplingParams(max_tokens=4))  # 4 pages on every rank during CP prefill
    s.add("b", list(range(1, 13)), SamplingParams(max_tokens=4))  # 3 more pages: must wait
    step = run_step(s)
    assert [p.request_id for p in step.prefill.pieces] == ["a"] and list(s.waiting) == ["b"]


def test_kv_exhaustion_preempts_the_newest_and_recomputes_it():
    s = scheduler(num_pages=6, cp_size=1, budget=32)
    s.add("old", list(range(1, 13)), SamplingParams(max_tokens=8))
    s.add("new", list(range(21, 33)), SamplingParams(max_tokens=8))  # no prefix in common with old
    run_step(s)  # both prefilled on rank 0: 3 + 3 pages
    step = s.schedule()
    assert step.preempted == ["new"] and step.plans[0].free == ("new",)
    new = s.requests["new"]  # its one output token (7) is the pending token again, not part of the prefill
    assert list(s.waiting) == ["new"] and (new.num_generated_at_prefill, new.resume_token()) == (0, 7)
    assert new.pages == {} and s.free_pages() == [6 - 4]  # old: 3 pages, + 1 to decode into
    assert [i.request_id for i in step.plans[0].decode] == ["old"]
    assert new.context_ids() == list(range(21, 33))


def test_finish_frees_on_every_rank_holding_kv_and_requests_that_cannot_fit_are_refused():
    s = scheduler()
    s.add("a", list(range(1, 30)), SamplingParams(max_tokens=4))
    run_step(s)  # first chunk: pages on both ranks
    assert s.free_pages() == [28, 28]
    s.finish("a")
    step = s.schedule()
    assert s.free_pages() == [32, 32]  # freed at once on both ranks that held the chunk
    # both ranks drop what they keep of it (DeepSeek-V4 files a prefilling request's state on every rank)
    assert {r: p.free for r, p in step.plans.items()} == {0: ("a",), 1: ("a",)} and not s.has_work()
    with pytest.raises(ValueError, match="needs 34 KV pages; a rank has 32"):
        s.add("big", list(range(1, 130)), SamplingParams(max_tokens=4))


def test_stop_ids_respect_min_tokens():
    params = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(9,))
    assert params.finish_reason(9, 1, (0,)) is None  # output 1 <= min_tokens: not a stop
    assert params.finish_reason(9, 2, (0,)) is None
    assert params.finish_reason(9, 3, (0,)) == "stop"
    assert params.finish_reason(0, 5, (0,)) == "stop"  # EOS wins over length at the last token
    assert params.finish_reason(4, 5, (0,)) == "length"
    assert SamplingParams(max_tokens=5, ignore_eos=True).finish_reason(0, 3, (0,)) is None


def test_decode_plans_carry_room_for_the_call_and_rollback_trims_it():
    s = scheduler(num_pages=32, cp_size=1, k=2, budget=32)
    s.add("x", list(range(1, 11)), SamplingParams(max_tokens=20))  # 10 tokens: 3 pages
    run_step(s)
    step = s.schedule()  # 4 steps x (k + 1) = 12 more positions: pages for 10 + 12 = 22 tokens
    (item,) = step.plans[0].decode
    assert (item.num_cached, len(item.pages)) == (10, 6) and s.free_pages() == [32 - 6]
    s.apply(step, {"x": RequestOutput("x", 7, token_ids=[7, 7, 7])})  # 3 tokens accepted in all
    assert s.requests["x"].num_cached == 13 and len(s.requests["x"].pages[0]) == 4 and s.free_pages() == [28]


def test_expert_parallel_steps_give_every_rank_a_lockstep_plan():
    s = Scheduler(SchedulerConfig(3, 32, 4, 64, "zigzag", "legacy", 1, 4, expert_parallel=True))
    s.add("short", [5, 6], SamplingParams(max_tokens=3))  # 2 tokens < 2C: one rank prefills, two join
    step = s.schedule()
    (runner,) = [r for r, plan in step.plans.items() if plan.prefill is not None]
    assert sorted(step.plans) == [0, 1, 2]
    assert all(plan.group_prefill_rows == tuple(2 if r == runner else 0 for r in range(3))
               for plan in step.plans.values())
    s.apply(step, outputs_for(step))
    s.add("long", list(range(1, 31)), SamplingParams(max_tokens=3))  # a CP batch beside one decoding request
    step = s.schedule()
    assert sorted(step.plans) == [0, 1, 2] and all(plan.group_decode for plan in step.plans.values())
    rows = [plan.prefill.meta.num_logical for _, plan in sorted(step.plans.items())]
    assert all(plan.group_prefill_rows == tuple(rows) for plan in step.plans.values()) and sum(rows) == 30
    assert [len(plan.decode) for _, plan in sorted(step.plans.items())] == [int(r == runner) for r in range(3)]
    assert len({(p.num_steps, p.num_speculative_steps) for p in step.plans.values()}) == 1  # same forwards


def test_without_expert_parallelism_idle_ranks_get_no_plan():
    s = scheduler(cp_size=3)
    s.add("short", [5, 6], SamplingParams(max_tokens=3))
    step = s.schedule()
    assert len(step.plans) == 1 and not next(iter(step.plans.values())).group_prefill_rows


def test_max_num_seqs_caps_the_running_requests_and_the_rest_wait_in_order():
    s = Scheduler(SchedulerConfig(2, 64, 4, 64, "zigzag", "legacy", 0, 4, max_num_seqs=2))
    for i in range(5):
        s.add(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=3))
    admitted = []
    while s.has_work():
        step = run_step(s)
        assert s.num_running() <= 2
        if step.prefill is not None:
            admitted += [p.request_id for p in step.prefill.pieces]
        for rid in [r for r, seq in s.requests.items() if len(seq.output_ids) >= 3]:
            s.finish(rid)
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
