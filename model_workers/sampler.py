"""Per-request token sampling from float32 logits: greedy at temperature 0, else one seeded draw."""

from __future__ import annotations

import torch

from cp_router.plans import SamplingParams


def request_generator(params: SamplingParams) -> torch.Generator:
    """The request's RNG; every rank seeds it alike, so all ranks draw the same token from the same logits."""
    return torch.Generator().manual_seed(params.seed)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits [vocab] float32 -> token id."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))
