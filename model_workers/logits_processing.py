"""What a request's sampling options do to the target's logits before a token is chosen (vLLM's semantics).

In order, on raw float32 logits [V]:
1. `logit_bias`: a value added to the listed token ids' logits;
2. `repetition_penalty` r (tokens of the prompt or the output so far): a positive logit is divided by r, a
   negative one multiplied by r;
3. `frequency_penalty` f and `presence_penalty` p (output tokens only): logit -= f * count + p * (count > 0).
`min_p` works on the distribution afterwards (sampler.target_probs). Speculative verification processes row j
with the history plus the first j drafts, exactly what plain decoding would have seen at that position, so
speculation stays lossless with every option. Reported logprobs stay the model's raw ones (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.sampling import SamplingParams


@dataclass
class TokenHistory:
    """The tokens the penalties look at: prompt ∪ output (`seen`) and the output counts, over the vocabulary."""

    seen: torch.Tensor  # [V] bool
    output_counts: torch.Tensor  # [V] float32

    @classmethod
    def of(cls, context_ids: tuple[int, ...], num_generated: int, vocab_size: int) -> TokenHistory:
        """`context_ids`: prompt then the `num_generated` output tokens so far."""
        ids = torch.tensor(context_ids, dtype=torch.long)
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[ids] = True
        counts = torch.zeros(vocab_size, dtype=torch.float32)
        if num_generated:
            counts.index_add_(0, ids[len(ids) - num_generated :], torch.ones(num_generated))
        return cls(seen, counts)

    def add(self, token_id: int) -> None:
        self.seen[token_id] = True
        self.output_counts[token_id] += 1

    def with_tokens(self, token_ids: list[int]) -> TokenHistory:
        """A copy with `token_ids` appended as output (a verify row's view after the drafts before it)."""
        copy = TokenHistory(self.seen.clone(), self.output_counts.clone())
        for token_id in token_ids:
            copy.add(token_id)
        return copy


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.needs_history


def process_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """Raw logits [V] -> the logits the request samples from (a new tensor when anything applies)."""
    if not needs_processing(params):
        return logits
    out = logits.float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        out[torch.tensor(ids, device=out.device)] += torch.tensor(bias, device=out.device)
    if params.needs_history:
        if history is None:
            raise ValueError("penalties need the request's token history")
        seen, counts = history.seen.to(out.device), history.output_counts.to(out.device)
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out
