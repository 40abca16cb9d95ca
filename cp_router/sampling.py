"""How one request picks its tokens and when it is finished: the one definition, shared by engine and ranks.

The stop rule lives here and only here: a token ends the request ("stop") when it is one of the request's stop
ids or the model's EOS (unless `ignore_eos`) and at least `min_tokens` tokens came before it; the request ends
with "length" at `max_tokens`. The rank that samples a token decides with `finish_reason` and reports it; the
engine acts on that report (stop strings, matched on text, are the engine's own addition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cp_router.grammar_spec import GrammarSpec

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # the request's counter-based random stream: same seed, same tokens, whatever the batch
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_tokens: int = 0  # EOS and stop ids are blocked before this many generated tokens
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and k top alternatives
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob + k top (the scheduler's)
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt and output tokens)
    presence_penalty: float = 0.0  # output tokens: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # output tokens: logit -= frequency * count
    min_p: float = 0.0  # tokens below min_p x the top probability are dropped (0 = off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: GrammarSpec | None = None  # structured outputs: tokens the grammar rejects are masked (None: free)

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "None or >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "None or >= 0"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """The penalties look at the request's tokens (the owner keeps a `TokenHistory`)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def stop_ids(self, eos_ids: tuple[int, ...]) -> list[int]:
        """The ids that end the request: its stop ids, then the model's EOS ids unless `ignore_eos`."""
        return list(self.stop_token_ids) + ([] if self.ignore_eos else list(eos_ids))

    def blocked_ids(self, eos_ids: tuple[int, ...], index: int) -> list[int]:
        """Ids that may not be output number `index` (0-based): every stop id before `min_tokens`."""
        return self.stop_ids(eos_ids) if index < self.min_tokens else []

    def finish_reason(self, token_id: int, num_generated: int, eos_ids: tuple[int, ...]) -> FinishReason | None:
        """After `token_id` became output number `num_generated` (1-based): "stop", "length" or None (go on)."""
        if token_id in self.stop_ids(eos_ids) and num_generated > self.min_tokens:
            return "stop"
        return "length" if num_generated >= self.max_tokens else None
