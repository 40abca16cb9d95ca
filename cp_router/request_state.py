"""Engine-side state of one request: its tokens, where its KV pages are, how far its prefill got, and the prompt
logprobs its prefill chunks have scored so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from cp_router.sampling import SamplingParams

WAITING, PREFILLING, DECODING = "waiting", "prefilling", "decoding"
# Prefill/decode disaggregation, decode side (cp_router/scheduler_handoff.py): waiting for room, holding its pages
# until the prefill group's hand-off arrives, and delivered (imported with its first decode step).
RESERVING, RESERVED, IMPORTING = "reserving", "reserved", "importing"


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int  # FCFS order; preemption picks the largest
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    owner: int | None = None  # cp_rank that decodes it (set by its first prefill chunk)
    num_cached: int = 0  # KV positions 0..num_cached-1 are cached on every rank in `pages`
    pages: dict[int, list[int]] = field(default_factory=dict)  # cp_rank -> its KV pages (scheduler-allocated)
    num_generated_at_prefill: int = 0  # output tokens folded into the context by a recompute
    resuming: bool = False  # recomputed with output: its last output token is the pending one (no new sample)
    drafted: int = 0
    accepted: int = 0
    num_preemptions: int = 0
    num_resumes: int = 0  # times its ranks were lost and it was requeued (cp_router/recovery.py)
    # Scored prompt logprobs (id, logprob, top, rank) per prompt position 1.. so far; None: not asked, or delivered.
    prompt_logprobs: list[tuple] | None = None
    # Prefix caching (cp_router/prefix_cache.py): content keys of its full pages so far, and the prompt tokens its
    # first prefill found cached (None: not looked up yet).
    page_keys: list[bytes] = field(default_factory=list)
    cached_tokens: int | None = None
    handoff: bool = False  # disaggregation, prefill side: handed off after its prefill instead of decoded here
    delivered: object = None  # disaggregation, decode side: the RequestHandoff to import (status IMPORTING)

    def context_ids(self) -> list[int]:
        """What prefill runs over: the prompt, plus earlier output but the last token when recomputing (that one
        is the pending token a decode step appends, as before the recompute)."""
        return self.prompt_ids + self.output_ids[: self.num_generated_at_prefill]

    def resume_token(self) -> int | None:
        """The streamed token a recompute's final chunk takes instead of a sample (`PrefillRequest.resume_token`)."""
        return self.output_ids[-1] if self.resuming else None

    def remaining_prefill(self) -> int:
        return len(self.context_ids()) - self.num_cached

    def reset_for_recompute(self) -> None:
        """Preempted, or its ranks lost their state (its pages already freed): the next prefill runs over the
        prompt + the output so far."""
        self.status, self.owner, self.num_cached, self.pages = WAITING, None, 0, {}
        self.num_generated_at_prefill, self.resuming = max(len(self.output_ids) - 1, 0), bool(self.output_ids)
        if self.prompt_logprobs is not None:  # not delivered yet: the new prefill scores the prompt again
            self.prompt_logprobs = []

    def wants_prompt_logprobs(self) -> int | None:
        """k for the next prefill chunk's prompt logprobs: None when not asked for or already delivered."""
        return self.sampling.prompt_logprobs if self.prompt_logprobs is not None else None
