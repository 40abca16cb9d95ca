"""The continuous-batching scheduler: pure Python over request state and KV pages, one lockstep plan per rank.

Each step: (1) rank-side state of aborted, finished and preempted requests is dropped; (2) the decode batch of
every rank (the requests it owns), several steps per call when no prefill waits; a rank whose pages would run
out first drops to one step, then preempts its newest request (pages freed, requeued for recompute); (3) one
prefill batch, FCFS, bounded by the token budget and by the free pages of every rank, run with CP across all
ranks (every rank holds every request of the batch) or, when too short to split or below
`cp_min_prefill_tokens`, data parallel: each prompt whole on its owner (the least loaded rank), the owners side by
side. A prompt longer than the budget is prefilled in chunks; a chunked piece is never shorter than the CP
alignment, so every batch holding one is split across all ranks and every rank keeps its prefix.

The scheduler owns the KV pages, one `PageAllocator` per rank (as nano-vllm's block manager does): it grows a
request's pages before the step that writes them, trims them after it (speculative rollback), frees the
non-owner ranks' pages after the final prefill chunk and all of them when the request ends. Plans carry the
page tables; ranks never allocate.

Prompt logprobs: the owner scores every chunk of a request that asked; the scheduler appends them in chunk order
and hands them over once, when the prefill completes (`take_prompt_logprobs`). A recompute after a preemption
scores them only if they were not delivered yet (the prefill was preempted before its final chunk).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from cp_router.pages import PageAllocator, pages_for
from cp_router.plans import DecodeItem, RequestOutput, StepPlan
from cp_router.prefix_cache import PrefixStats, register_pages
from cp_router.request_state import DECODING, PREFILLING, RESERVED, WAITING, RequestState
from cp_router.sampling import SamplingParams
from cp_router.scheduler_handoff import admit_reservations, import_items, requeue_reservations, start_imports
from cp_router.scheduler_prefill import PrefillBatch, build_prefill_batch, plan_prefill_batch


@dataclass(frozen=True)
class SchedulerConfig:
    cp_size: int
    num_pages: int  # per rank
    page_size: int
    prefill_token_budget: int = 2048
    strategy: str = "zigzag"
    impl: str = "legacy"
    num_speculative_steps: int = 0
    max_steps_per_call: int = 4  # decode steps per worker call when nothing else waits
    return_logits: bool = False  # ranks ship full-vocabulary logits back (tests, debugging)
    expert_parallel: bool = False  # ep_size = cp_size: every rank takes part in every forward (lockstep)
    max_num_seqs: int = 256  # requests admitted at once (prefilling or decoding); the rest wait
    cp_min_prefill_tokens: int = 0  # a batch of fewer new prompt tokens runs data parallel (scheduler_prefill.uses_cp)
    time_prefill_phases: bool = False  # prefill steps timed by phase (StepPlan.time_prefill_phases; benchmarks)
    prefix_caching: bool = True  # reuse cached prefix pages (cp_router/prefix_cache.py)
    hit_align: int = 0  # a cache hit ends at a multiple of this (0: the page size; V4: also its compress rates)
    state_snapshots: bool = False  # the family keeps bounded per-request state: hits only where it was snapshotted

    @property
    def prefix_align(self) -> int:
        return self.hit_align or self.page_size


@dataclass
class ScheduledStep:
    plans: dict[int, StepPlan]  # cp_rank -> plan; ranks with nothing to do get none
    prefill: PrefillBatch | None = None
    decode_ids: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    reserved: list[str] = field(default_factory=list)  # disaggregation: reservations given their pages this step


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.requests: dict[str, RequestState] = {}
        self.waiting: deque[str] = deque()
        self.reserving: deque[str] = deque()  # disaggregation: waiting for room for a hand-off (scheduler_handoff.py)
        self.allocators = [PageAllocator(config.num_pages) for _ in range(config.cp_size)]
        self.pending_free: dict[int, set[str]] = {r: set() for r in range(config.cp_size)}
        self.prefix_stats = PrefixStats()
        self._arrivals = 0

    # requests in and out -------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, handoff: bool = False) -> None:
        """Queues a request for prefill here; `handoff`: a prefill group's, handed off after its prefill."""
        cfg = self.config
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        worst = len(prompt_ids) + sampling.max_tokens + cfg.num_speculative_steps + 1
        if not prompt_ids or pages_for(worst, cfg.page_size) > cfg.num_pages:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) needs"
                f" {pages_for(worst, cfg.page_size)} KV pages; a rank has {cfg.num_pages}"
            )
        self.requests[request_id] = RequestState(request_id, list(prompt_ids), sampling, self._arrivals,
                                                 prompt_logprobs=None if sampling.prompt_logprobs is None else [],
                                                 handoff=handoff)
        self._arrivals += 1
        self.waiting.append(request_id)

    def finish(self, request_id: str) -> None:
        """Aborted or finished: forget it, free its pages now and its rank-side state at the next step."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        for queue in (self.waiting, self.reserving):
            if request_id in queue:
                queue.remove(request_id)
        self._release(seq)

    def restart_all(self) -> list[str]:
        """The ranks lost every request's state (a rank was replaced, the group re-formed): every page is free
        again and every request waits, in arrival order, to be prefilled over its prompt plus the tokens it
        already produced (reserved hand-offs wait for room again). Returns the requeued ids."""
        requeue_reservations(self)
        reserving = set(self.reserving)
        for seq in self.requests.values():
            if seq.request_id not in reserving:
                seq.reset_for_recompute()
        self.allocators = [PageAllocator(self.config.num_pages) for _ in range(self.config.cp_size)]
        self.pending_free = {r: set() for r in range(self.config.cp_size)}
        self.waiting = deque(sorted((rid for rid in self.requests if rid not in reserving),
                                    key=lambda rid: self.requests[rid].arrival))
        return list(self.waiting)

    def has_work(self) -> bool:
        """Anything to run or free (a reserved request waiting for its hand-off is not)."""
        return any(s.status != RESERVED or s.delivered is not None for s in self.requests.values()) \
            or any(self.pending_free.values())

    def free_pages(self) -> list[int]:
        return [allocator.num_free for allocator in self.allocators]

    def num_running(self) -> int:
        return len(self.requests) - len(self.waiting) - len(self.reserving)

    def flush_prefix_cache(self) -> int:
        """Empties every rank's prefix cache (pages in use stay with their requests); returns the pages unindexed."""
        return sum(allocator.flush() for allocator in self.allocators)

    def cached_pages(self) -> list[int]:
        """Per rank: pages indexed by content (in use or evictable)."""
        return [allocator.num_cached for allocator in self.allocators]

    def _release(self, seq: RequestState) -> None:
        """Frees every page the request holds (its full, final pages stay cached: cp_router/prefix_cache.py); at
        the next step its owner drops its draft state, and every rank that holds its pages (mid chunked prefill)
        the state it keeps there."""
        if seq.owner in seq.pages:
            register_pages(self, seq, seq.owner, seq.num_cached)
        for cp_rank, pages in seq.pages.items():
            self.allocators[cp_rank].free(pages)
            self.pending_free[cp_rank].add(seq.request_id)
        seq.pages = {}
        if seq.owner is not None:
            self.pending_free[seq.owner].add(seq.request_id)

    # one step -----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        cfg = self.config
        reserved, started = admit_reservations(self), start_imports(self)
        decoding = [s for s in self.requests.values() if s.status == DECODING and not s.handoff]
        prefill_waits = bool(self.waiting) or any(s.status == PREFILLING for s in self.requests.values())
        num_steps = 1 if prefill_waits else cfg.max_steps_per_call
        preempted = self._fit_decode(decoding)
        decoding = [s for s in decoding if s.status == DECODING]
        imports = import_items(started)
        if not self._decode_fits(decoding, num_steps):
            num_steps = 1
        for seq in decoding:  # room for every token the call may write (speculation: k + 1 per step)
            self.allocators[seq.owner].grow(seq.pages[seq.owner], seq.num_cached + self._growth(num_steps),
                                            cfg.page_size)
        batch = plan_prefill_batch(self)
        plans = self._decode_plans(decoding, num_steps)
        shards = build_prefill_batch(self, batch) if batch is not None else {}
        for cp_rank, shard in shards.items():
            plans[cp_rank] = StepPlan(prefill=shard, decode=plans.get(cp_rank, StepPlan()).decode,
                                      return_logits=cfg.return_logits, num_steps=num_steps,
                                      num_speculative_steps=cfg.num_speculative_steps,
                                      time_prefill_phases=cfg.time_prefill_phases)
        if cfg.expert_parallel and (shards or decoding):
            plans = self._lockstep_plans(plans, shards, bool(decoding), num_steps)
        for cp_rank, items in imports.items():
            plans[cp_rank] = replace(plans[cp_rank], imports=tuple(items))
        for cp_rank, request_ids in self.pending_free.items():
            if request_ids:
                plans[cp_rank] = replace(plans.get(cp_rank, StepPlan()), free=tuple(sorted(request_ids)))
                request_ids.clear()
        for cp_rank, allocator in enumerate(self.allocators):
            if dropped := allocator.take_dropped_snapshots():
                plans[cp_rank] = replace(plans.get(cp_rank, StepPlan()), drop_snapshots=tuple(dropped))
        return ScheduledStep(plans, batch, [s.request_id for s in decoding], preempted, reserved)

    def _lockstep_plans(self, plans: dict[int, StepPlan], shards: dict, decoding: bool,
                        num_steps: int) -> dict[int, StepPlan]:
        """Expert parallelism: a plan for every rank, each naming the rows every rank brings to the prefill
        forward and whether the group decodes, so that ranks without work of their own join in lockstep."""
        cfg = self.config
        prefill_rows = tuple(shards[r].meta.num_logical if r in shards else 0 for r in range(cfg.cp_size)) \
            if shards else ()
        base = StepPlan(return_logits=cfg.return_logits, num_steps=num_steps,
                        num_speculative_steps=cfg.num_speculative_steps)
        return {r: replace(plans.get(r, base), group_prefill_rows=prefill_rows, group_decode=decoding)
                for r in range(cfg.cp_size)}

    def _growth(self, num_steps: int) -> int:
        return num_steps * (self.config.num_speculative_steps + 1)

    def _growth_pages(self, seq: RequestState, num_steps: int) -> int:
        needed = pages_for(seq.num_cached + self._growth(num_steps), self.config.page_size)
        return max(0, needed - len(seq.pages[seq.owner]))

    def _decode_need(self, decoding: list[RequestState], cp_rank: int, num_steps: int) -> int:
        """New pages rank `cp_rank` must hand its decoding requests for a call of `num_steps` steps."""
        return sum(self._growth_pages(s, num_steps) for s in decoding if s.owner == cp_rank and s.status == DECODING)

    def _decode_fits(self, decoding: list[RequestState], num_steps: int) -> bool:
        return all(self._decode_need(decoding, r, num_steps) <= self.allocators[r].num_free
                   for r in range(self.config.cp_size))

    def _fit_decode(self, decoding: list[RequestState]) -> list[str]:
        """Preempts the newest request holding pages on a rank until one decode step fits there."""
        preempted = []
        for cp_rank in range(self.config.cp_size):
            while self._decode_need(decoding, cp_rank, 1) > self.allocators[cp_rank].num_free:
                victim = max((s for s in self.requests.values() if s.pages.get(cp_rank) and s.status != RESERVED),
                             key=lambda s: s.arrival)
                self._release(victim)
                victim.reset_for_recompute()
                victim.num_preemptions += 1
                self._requeue(victim.request_id)
                preempted.append(victim.request_id)
        return preempted

    def _requeue(self, request_id: str) -> None:
        """Back into the waiting queue at its FCFS place (by arrival)."""
        arrival = self.requests[request_id].arrival
        ahead = [rid for rid in self.waiting if self.requests[rid].arrival < arrival]
        self.waiting.insert(len(ahead), request_id)

    def _decode_plans(self, decoding: list[RequestState], num_steps: int) -> dict[int, StepPlan]:
        per_rank: dict[int, list[DecodeItem]] = {}
        for seq in decoding:
            remaining = seq.sampling.max_tokens - len(seq.output_ids)
            item = DecodeItem(seq.request_id, seq.output_ids[-1], seq.num_cached, tuple(seq.pages[seq.owner]),
                              len(seq.output_ids), remaining)
            per_rank.setdefault(seq.owner, []).append(item)
        k, logits = self.config.num_speculative_steps, self.config.return_logits
        return {r: StepPlan(decode=tuple(items), return_logits=logits, num_steps=num_steps, num_speculative_steps=k)
                for r, items in per_rank.items()}

    # results -------------------------------------------------------------------------------------
    def apply(self, step: ScheduledStep, outputs: dict[str, RequestOutput]) -> dict[str, list[int]]:
        """Folds the owners' `RequestOutput`s into the state; returns each live request's new tokens."""
        new_tokens: dict[str, list[int]] = {}
        if step.prefill is not None:
            step.prefill.apply(self, outputs, new_tokens)
        for request_id in step.decode_ids:
            seq, out = self.requests.get(request_id), outputs.get(request_id)
            if seq is None or out is None:
                continue  # aborted while the step ran
            seq.output_ids += out.token_ids
            seq.num_cached += len(out.token_ids)  # the previous last token and all new ones but the last
            seq.drafted += out.drafted
            seq.accepted += sum(out.accepted_per_position)
            self.allocators[seq.owner].trim(seq.pages[seq.owner], seq.num_cached, self.config.page_size)
            new_tokens[request_id] = list(out.token_ids)
        return new_tokens

    def take_prompt_logprobs(self, request_id: str) -> list[tuple] | None:
        """Once, after a request's prefill completed: its prompt logprobs (position 1 on) when it asked for them."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status != DECODING or seq.prompt_logprobs is None:
            return None
        taken, seq.prompt_logprobs = seq.prompt_logprobs, None
        return taken


__all__ = ["Scheduler", "SchedulerConfig", "ScheduledStep", "WAITING", "PREFILLING", "DECODING"]
