"""Router-side state of one request: its tokens, where its KV lives, and when it is finished."""

from __future__ import annotations

from dataclasses import dataclass, field

from cp_router.plans import SamplingParams

WAITING, PREFILLING, DECODING = "waiting", "prefilling", "decoding"


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int  # FCFS order; preemption picks the largest
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    owner: int | None = None  # cp_rank that decodes it (set by its first prefill chunk)
    prefilled: int = 0  # tokens of `context_ids()` whose KV is cached (the next chunk's prefix)
    kv_tokens: dict[int, int] = field(default_factory=dict)  # cp_rank -> KV tokens it holds there
    num_generated_at_prefill: int = 0  # output tokens folded into the context by a recompute
    drafted: int = 0
    accepted: int = 0
    num_preemptions: int = 0

    def context_ids(self) -> list[int]:
        """What prefill runs over: the prompt, plus earlier output when recomputing after a preemption."""
        return self.prompt_ids + self.output_ids[: self.num_generated_at_prefill]

    def remaining_prefill(self) -> int:
        return len(self.context_ids()) - self.prefilled

    def stop_ids(self, eos_ids: tuple[int, ...]) -> set[int]:
        return set(self.sampling.stop_token_ids) | (set() if self.sampling.ignore_eos else set(eos_ids))

    def finish_reason(self, eos_ids: tuple[int, ...]) -> str | None:
        """"stop" after a stop id / EOS past min_tokens, "length" at max_tokens, else None (the worker's rule)."""
        if not self.output_ids:
            return None
        if self.output_ids[-1] in self.stop_ids(eos_ids) and len(self.output_ids) > self.sampling.min_tokens:
            return "stop"
        return "length" if len(self.output_ids) >= self.sampling.max_tokens else None

    def reset_for_recompute(self) -> None:
        """Preempted: KV gone; the next prefill runs over prompt + output so far."""
        self.status, self.owner, self.prefilled, self.kv_tokens = WAITING, None, 0, {}
        self.num_generated_at_prefill = len(self.output_ids)
        self.num_preemptions += 1


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)
