"""The prefix cache on the scheduler's side (no model, no Ray): page keys, the allocator's index and LRU, the hit a
request takes (page aligned, at least one token left, CP or one rank), shared pages never written, exact reference
counts under random interleavings of hits, evictions, aborts, preemption and a rank restart."""

import random

import pytest

from cp_router.pages import OutOfPages, PageAllocator
from cp_router.plans import RequestOutput
from cp_router.prefix_cache import extend_keys
from cp_router.sampling import SamplingParams
from cp_router.scheduler import Scheduler, SchedulerConfig


def scheduler(num_pages: int = 64, cp_size: int = 2, k: int = 0, budget: int = 64, caching: bool = True,
              hit_align: int = 0, snapshots: bool = False, cp_min: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(cp_size, num_pages, 4, budget, "zigzag", "legacy", k, 4,
                                     cp_min_prefill_tokens=cp_min, prefix_caching=caching, hit_align=hit_align,
                                     state_snapshots=snapshots))


def run_step(s: Scheduler, token: int = 7, finish: tuple[str, ...] = ()):
    step = s.schedule()
    count = step.plans[next(iter(step.plans))].num_steps if step.decode_ids else 1
    ids = list(step.decode_ids) + [p.request_id for p in (step.prefill.pieces if step.prefill else ()) if p.final]
    outputs = {}
    for rid in ids:  # a request ends at its max_tokens (as a rank would end it) or when told to
        seq = s.requests[rid]
        emitted = min(count, seq.sampling.max_tokens - len(seq.output_ids)) if rid in step.decode_ids else 1
        done = rid in finish or len(seq.output_ids) + emitted >= seq.sampling.max_tokens
        outputs[rid] = RequestOutput(rid, token, token_ids=[token] * emitted, finish_reason="stop" if done else None)
    for request_id, _ in s.apply(step, outputs).items():
        if outputs[request_id].finish_reason:
            s.finish(request_id)
    return step


def drain(s: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        run_step(s)
    raise AssertionError("the scheduler did not finish its requests")


def test_page_keys_chain_the_tokens_and_with_speculation_the_token_after_each_page():
    a, b = extend_keys([], list(range(1, 14)), 4), extend_keys([], list(range(1, 13)) + [99], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # page 3's next token differs
    assert extend_keys([], [1, 2, 3, 4], 4) == []  # no token after the only page: not keyed
    assert extend_keys([], [5] + list(range(2, 14)), 4)[1] != a[1]  # the chain: an earlier page differs
    plain = [extend_keys([], list(range(1, 13)) + [last], 4, next_token=False) for last in (13, 99)]
    assert len(plain[0]) == 3 and plain[0] == plain[1]  # without speculation the next token is not read


def test_with_speculation_a_hit_needs_the_token_after_its_last_page():
    s = scheduler(cp_size=1, k=2)
    s.add("a", list(range(1, 21)) + [90], SamplingParams(max_tokens=2))
    run_step(s)
    s.add("b", list(range(1, 21)) + [91, 92], SamplingParams(max_tokens=2))
    assert run_step(s).prefill.pieces[0].prefix_len == 16  # page 5's MTP row took token 90, b has 91


def test_the_allocator_evicts_least_recent_cached_pages_and_never_one_in_use():
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    for page, key in zip(pages, [b"a", b"b", b"c", b"d"]):
        allocator.register(page, key)
    allocator.free(pages[:3])  # c, b, a cached (a request's tail first), d in use
    assert allocator.num_free == 3 and allocator.lookup([b"a", b"b", b"x"]) == pages[:2]
    allocator.share([pages[0]])  # a taken back: in use again
    fresh = allocator.allocate(1)  # evicts c, the least recently released unreferenced page
    assert fresh == [pages[2]] and allocator.lookup([b"a", b"b", b"c"]) == pages[:2] and allocator.evictions == 1
    with pytest.raises(OutOfPages):
        allocator.allocate(2)  # b is the only evictable page; a and d are in use
    allocator.check()


def test_a_second_request_starts_after_the_cached_prefix_and_shares_its_pages():
    s = scheduler(cp_size=1)
    prompt = list(range(1, 22))  # 21 tokens: 5 full pages of 4
    s.add("first", prompt, SamplingParams(max_tokens=10))
    run_step(s)
    s.add("second", prompt, SamplingParams(max_tokens=2))
    step = run_step(s)
    piece = step.prefill.pieces[0]
    assert (piece.prefix_len, piece.extend_len) == (20, 1)  # 5 pages cached; the last token is prefilled
    first, second = s.requests["first"], s.requests["second"]
    assert second.cached_tokens == 20 and first.cached_tokens == 0
    assert second.pages[0][:5] == first.pages[0][:5] and second.pages[0][5] != first.pages[0][5]
    assert step.plans[0].prefill.page_tables[0][:5] == tuple(first.pages[0][:5])
    assert (s.prefix_stats.queries, s.prefix_stats.hits) == (42, 20)


def test_a_whole_cached_prompt_still_prefills_its_last_token():
    s = scheduler(cp_size=1)
    s.add("a", list(range(1, 17)), SamplingParams(max_tokens=3))
    drain(s)
    s.add("b", list(range(1, 17)), SamplingParams(max_tokens=3))
    piece = run_step(s).prefill.pieces[0]
    assert (piece.prefix_len, piece.extend_len) == (12, 4)  # page 4's next token is not in b's context


def test_output_pages_of_a_finished_request_serve_the_next_turn():
    s = scheduler(cp_size=1)
    s.add("turn1", list(range(1, 11)), SamplingParams(max_tokens=9))
    drain(s)  # 10 prompt tokens + 9 outputs (7 each): positions 0..17 cached
    s.add("turn2", list(range(1, 11)) + [7] * 9 + [50, 51, 52], SamplingParams(max_tokens=2))
    piece = run_step(s).prefill.pieces[0]
    assert piece.prefix_len == 16  # 4 full pages of prompt + answer


def test_disabled_caching_never_hits():
    s = scheduler(cp_size=1, caching=False)
    for name in ("a", "b"):
        s.add(name, list(range(1, 30)), SamplingParams(max_tokens=2))
        step = run_step(s)
        assert step.prefill.pieces[0].prefix_len == 0
    assert s.requests["b"].cached_tokens is None and s.cached_pages() == [0]


def test_under_cp_the_non_owners_copies_stay_cached_and_a_long_suffix_hits_on_every_rank():
    s = scheduler(cp_size=2)
    doc = list(range(1, 33))  # 32 tokens, CP prefill: every rank holds every page
    s.add("a", doc + [90, 91], SamplingParams(max_tokens=2))
    run_step(s)
    assert all(cached >= 8 for cached in s.cached_pages())  # 8 doc pages on each rank, the owner's in use
    s.add("b", doc + [90] + list(range(100, 119)), SamplingParams(max_tokens=2))  # page 8's next token too
    step = run_step(s)
    piece = step.prefill.pieces[0]
    assert step.prefill.cp and (piece.prefix_len, piece.extend_len) == (32, 20)
    assert [len(step.plans[r].prefill.page_tables[0]) for r in (0, 1)] == [13, 13]
    assert step.plans[0].prefill.page_tables[0][:8] == tuple(s.allocators[0].lookup(s.requests["b"].page_keys)[:8])


def test_a_short_suffix_after_a_hit_runs_on_one_rank_that_holds_the_prefix():
    s = scheduler(cp_size=2)
    s.add("a", list(range(1, 33)) + [90], SamplingParams(max_tokens=2))
    run_step(s)
    s.add("b", list(range(1, 33)) + [90, 96], SamplingParams(max_tokens=2))
    step = run_step(s)
    piece = step.prefill.pieces[0]
    assert not step.prefill.cp and (piece.prefix_len, piece.extend_len) == (32, 2)
    assert list(s.requests["b"].pages) == [step.prefill.owners[0]]


def test_a_prefix_on_one_rank_only_is_used_there_when_that_beats_a_fresh_cp_prefill():
    s = scheduler(cp_size=2, cp_min=1000)  # short prompts run data parallel: a's pages live on its owner only
    s.add("a", list(range(1, 41)), SamplingParams(max_tokens=2))
    step = run_step(s)
    owner = step.prefill.owners[0]
    s.add("b", list(range(1, 41)) + [7, 78, 79], SamplingParams(max_tokens=2))  # a's first output token, 7
    step = run_step(s)
    assert step.prefill.owners == (owner,) and step.prefill.pieces[0].prefix_len == 40


def test_prompt_logprobs_requests_prefill_everything():
    s = scheduler(cp_size=1)
    s.add("a", list(range(1, 30)), SamplingParams(max_tokens=2))
    run_step(s)
    s.add("b", list(range(1, 30)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert run_step(s).prefill.pieces[0].prefix_len == 0


def test_bounded_state_hits_only_where_a_snapshot_was_taken():
    s = scheduler(cp_size=1, hit_align=8, snapshots=True)
    s.add("a", list(range(1, 22)), SamplingParams(max_tokens=2))
    first = run_step(s).prefill.pieces[0]
    assert (first.extend_len, first.final, first.snapshot) == (16, False, True)  # stops at the boundary
    last = run_step(s).prefill.pieces[0]
    assert (last.prefix_len, last.extend_len, last.final, last.snapshot) == (16, 5, True, False)
    s.add("b", list(range(1, 22)) + [60], SamplingParams(max_tokens=2))
    assert run_step(s).prefill.pieces[0].prefix_len == 16  # 20 tokens are cached, the snapshot is at 16
    snapshot_page = s.requests["b"].pages[0][3]
    s.flush_prefix_cache()  # b keeps the page (its own state is a copy), but nothing can hit it any more
    assert s.allocators[0].take_dropped_snapshots() == [snapshot_page]


def test_evicting_a_snapshot_page_tells_its_rank():
    s = scheduler(cp_size=1, num_pages=10, hit_align=8, snapshots=True)
    s.add("a", list(range(1, 18)), SamplingParams(max_tokens=1))
    drain(s)
    snapshot_page = s.allocators[0].lookup(extend_keys([], list(range(1, 18)) + [7], 4, next_token=False))[3]
    assert s.allocators[0].has_snapshot(snapshot_page)
    s.add("b", list(range(100, 137)), SamplingParams(max_tokens=1))  # all 10 pages: evicts a's cached ones
    step = s.schedule()
    assert snapshot_page in step.plans[0].drop_snapshots


def test_a_rank_keeps_a_bounded_number_of_snapshots_least_recently_used_dropped_first():
    allocator = PageAllocator(8, max_snapshots=2)
    pages = allocator.allocate(3)
    for page, key in zip(pages, [b"a", b"b", b"c"]):
        allocator.register(page, key)
    allocator.mark_snapshot(pages[0])
    allocator.mark_snapshot(pages[1])
    allocator.share([pages[0]])  # a hit on page 0: used most recently now
    allocator.mark_snapshot(pages[2])
    assert allocator.take_dropped_snapshots() == [pages[1]]
    assert [allocator.has_snapshot(p) for p in pages] == [True, False, True]
    allocator.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_reference_counts_exact(seed: int):
    rng = random.Random(seed)
    cp_size = rng.choice([1, 2])
    s = scheduler(num_pages=24, cp_size=cp_size, k=rng.choice([0, 2]), budget=16,
                  hit_align=rng.choice([0, 8]), snapshots=rng.random() < 0.3, cp_min=rng.choice([0, 12]))
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    for i in range(40):
        action = rng.random()
        if action < 0.35:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
            s.add(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 8)))
        elif action < 0.45 and s.requests:
            s.finish(rng.choice(sorted(s.requests)))  # abort, whatever its state
        elif action < 0.48:
            s.restart_all()
        elif action < 0.5:
            s.flush_prefix_cache()
        else:
            run_step(s, token=rng.randrange(1, 50), finish=tuple(r for r in s.requests if rng.random() < 0.1))
        check_counts(s)
    drain(s)
    check_counts(s)
    assert all(a.num_used == 0 for a in s.allocators)  # every page free or cached: nothing leaked


def check_counts(s: Scheduler) -> None:
    """Each rank's references equal the pages the live requests hold; every page in exactly one state."""
    for cp_rank, allocator in enumerate(s.allocators):
        allocator.check()
        held: dict[int, int] = {}
        for seq in s.requests.values():
            for page in seq.pages.get(cp_rank, []):
                held[page] = held.get(page, 0) + 1
        assert held == allocator._refs
