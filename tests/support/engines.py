"""Helpers of the engine tests: C = 1 engines in this process and request builders."""

from __future__ import annotations

import torch

from cluster.engine_setup import start_local_engine
from cluster.engine_spec import EngineOptions
from cp_router.engine import GenerationEngine
from cp_router.protocol import EngineRequest


def local_engine(model_dir, options: EngineOptions) -> GenerationEngine:
    return start_local_engine(model_dir, options)


def make_requests(lens: list[int], max_tokens: int | list[int], vocab: int, prompt_seed: int = 0,
                  **kwargs) -> list[EngineRequest]:
    generator = torch.Generator().manual_seed(prompt_seed)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(lens)
    return [
        EngineRequest(f"r{i}", tuple(torch.randint(1, vocab, (n,), generator=generator).tolist()), budget, **kwargs)
        for i, (n, budget) in enumerate(zip(lens, budgets))
    ]
