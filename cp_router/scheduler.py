"""The continuous-batching scheduler: pure Python over request state, one lockstep plan per rank per step.

Each step: (1) frees queued by aborts, finishes and preemptions; (2) the decode batch of every rank (the
requests it owns), several steps per call when no prefill waits; a rank whose KV would overflow first
drops to one step, then preempts its newest request (pages freed, requeued for recompute); (3) one prefill
batch, FCFS, bounded by the token budget and by the free pages of every rank, run with CP across all ranks
(every rank reserves every request of the batch) or, when too short to split, on the least loaded rank.
A prompt longer than the budget is prefilled in chunks; a chunked piece is never shorter than the CP
alignment, so every batch holding one is split across all ranks and every rank keeps its prefix.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cp_router.plans import DecodeItem, StepPlan
from cp_router.request_state import DECODING, PREFILLING, WAITING, RequestState, pages_for
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
    eos_ids: tuple[int, ...] = ()


@dataclass
class ScheduledStep:
    plans: dict[int, StepPlan]  # cp_rank -> plan; ranks with nothing to do get none
    prefill: PrefillBatch | None = None
    decode_ids: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.sequences: dict[str, RequestState] = {}
        self.waiting: deque[str] = deque()
        self.pending_free: dict[int, set[str]] = {r: set() for r in range(config.cp_size)}
        self._arrivals = 0

    # requests in and out -------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], sampling) -> None:
        cfg = self.config
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already running")
        worst = len(prompt_ids) + sampling.max_tokens + cfg.num_speculative_steps + 1
        if not prompt_ids or pages_for(worst, cfg.page_size) > cfg.num_pages:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) needs"
                f" {pages_for(worst, cfg.page_size)} KV pages; a rank has {cfg.num_pages}"
            )
        self.sequences[request_id] = RequestState(request_id, list(prompt_ids), sampling, self._arrivals)
        self._arrivals += 1
        self.waiting.append(request_id)

    def finish(self, request_id: str) -> None:
        """Aborted or finished: forget it and free its pages on every rank at the next step."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        for cp_rank in seq.kv_tokens:
            self.pending_free[cp_rank].add(request_id)

    def has_work(self) -> bool:
        return bool(self.sequences) or any(self.pending_free.values())

    def pages_used(self, cp_rank: int) -> int:
        return sum(pages_for(s.kv_tokens.get(cp_rank, 0), self.config.page_size) for s in self.sequences.values())

    def num_running(self) -> int:
        return len(self.sequences) - len(self.waiting)

    # one step -----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        cfg = self.config
        decoding = [s for s in self.sequences.values() if s.status == DECODING]
        prefill_waits = bool(self.waiting) or any(s.status == PREFILLING for s in self.sequences.values())
        num_steps = 1 if prefill_waits else cfg.max_steps_per_call
        preempted = self._fit_decode(decoding, num_steps)
        decoding = [s for s in decoding if s.status == DECODING]
        if any(self._decode_need(decoding, r, num_steps) > cfg.num_pages for r in range(cfg.cp_size)):
            num_steps = 1
        batch = plan_prefill_batch(self, self._decode_need_all(decoding, num_steps))
        plans = self._decode_plans(decoding, num_steps)
        if batch is not None:
            for cp_rank, shard in build_prefill_batch(self, batch).items():
                plans[cp_rank] = StepPlan(prefill=shard, decode=plans.get(cp_rank, StepPlan()).decode,
                                          num_steps=num_steps, num_speculative_steps=cfg.num_speculative_steps)
        for cp_rank, request_ids in self.pending_free.items():
            if request_ids:
                base = plans.get(cp_rank, StepPlan())
                plans[cp_rank] = StepPlan(base.prefill, base.decode, False, tuple(sorted(request_ids)),
                                          base.num_steps, base.num_speculative_steps)
                request_ids.clear()
        return ScheduledStep(plans, batch, [s.request_id for s in decoding], preempted)

    def _growth(self, num_steps: int) -> int:
        return num_steps * (self.config.num_speculative_steps + 1)

    def _decode_need(self, decoding: list[RequestState], cp_rank: int, num_steps: int) -> int:
        """Pages rank `cp_rank` holds during the decode call (worst case) plus every other request's pages."""
        growth, decoding_ids = self._growth(num_steps), {s.request_id for s in decoding}
        need = 0
        for seq in self.sequences.values():
            tokens = seq.kv_tokens.get(cp_rank, 0)
            grows = tokens and seq.request_id in decoding_ids
            need += pages_for(tokens + (growth if grows else 0), self.config.page_size)
        return need

    def _decode_need_all(self, decoding: list[RequestState], num_steps: int) -> list[int]:
        return [self._decode_need(decoding, r, num_steps) for r in range(self.config.cp_size)]

    def _fit_decode(self, decoding: list[RequestState], num_steps: int) -> list[str]:
        """Preempts the newest request holding KV on a rank until one decode step fits there."""
        preempted = []
        for cp_rank in range(self.config.cp_size):
            while self._decode_need(decoding, cp_rank, 1) > self.config.num_pages:
                holders = [s for s in self.sequences.values() if s.kv_tokens.get(cp_rank)]
                victim = max(holders, key=lambda s: s.arrival)
                for r in victim.kv_tokens:
                    self.pending_free[r].add(victim.request_id)
                victim.reset_for_recompute()
                self._requeue(victim.request_id)
                preempted.append(victim.request_id)
        return preempted

    def _requeue(self, request_id: str) -> None:
        """Back into the waiting queue at its FCFS place (by arrival)."""
        arrival = self.sequences[request_id].arrival
        ahead = [rid for rid in self.waiting if self.sequences[rid].arrival < arrival]
        self.waiting.insert(len(ahead), request_id)

    def _decode_plans(self, decoding: list[RequestState], num_steps: int) -> dict[int, StepPlan]:
        per_rank: dict[int, list[DecodeItem]] = {}
        for seq in decoding:
            remaining = seq.sampling.max_tokens - len(seq.output_ids)
            item = DecodeItem(seq.request_id, seq.output_ids[-1], len(seq.output_ids), remaining)
            per_rank.setdefault(seq.owner, []).append(item)
        k = self.config.num_speculative_steps
        return {r: StepPlan(decode=tuple(items), num_steps=num_steps, num_speculative_steps=k)
                for r, items in per_rank.items()}

    # results -------------------------------------------------------------------------------------
    def apply(self, step: ScheduledStep, outputs: dict) -> dict[str, list[int]]:
        """Folds the owners' `RequestOutput`s into the state; returns each live request's new tokens."""
        new_tokens: dict[str, list[int]] = {}
        if step.prefill is not None:
            step.prefill.apply(self, outputs, new_tokens)
        for request_id in step.decode_ids:
            seq, out = self.sequences.get(request_id), outputs.get(request_id)
            if seq is None or out is None:
                continue  # aborted while the step ran
            seq.output_ids += out.token_ids
            seq.kv_tokens[seq.owner] += len(out.token_ids)
            seq.drafted += out.drafted
            seq.accepted += sum(out.accepted_per_position)
            new_tokens[request_id] = list(out.token_ids)
        return new_tokens


__all__ = ["Scheduler", "SchedulerConfig", "ScheduledStep", "WAITING", "PREFILLING", "DECODING"]
