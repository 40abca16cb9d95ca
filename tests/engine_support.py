"""Helpers of the engine tests: in-process rank workers (no Ray) and request builders."""

from __future__ import annotations

import asyncio

import torch

from cluster.engine import DSAEngine
from cluster.engine_launch import EngineOptions, scheduler_for
from cluster.engine_protocol import EngineRequest, ModelInfo
from cluster.config import ResolvedCPConfig
from model_workers.cp_worker import CPWorker
from model_workers.tokenizer import load_tokenizer


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future


class InProcessWorker:
    """A CPWorker called like a Ray actor handle (`.step.remote(plan)` is awaitable), cp_size 1 only."""

    def __init__(self, model_dir, dtype: str, num_pages: int, page_size: int):
        self.worker = CPWorker(0, 1)
        self.worker.load(str(model_dir), dtype, num_pages, page_size)
        self.step, self.free_pages = _Method(self.worker.step), _Method(self.worker.free_pages)


def local_engine(model_dir, options: EngineOptions) -> DSAEngine:
    """A C = 1 engine in this process."""
    cp = ResolvedCPConfig(enabled=False, cp_size=1, strategy=None, impl="legacy")
    worker = InProcessWorker(model_dir, options.dtype, options.num_pages, options.page_size)
    config = worker.worker.runner.model.config
    scheduler = scheduler_for(cp, options, config.eos_token_ids)
    info = ModelInfo("test", config.vocab_size, config.max_position_embeddings, False)
    return DSAEngine([worker], scheduler, load_tokenizer(model_dir), info)


def make_requests(lens: list[int], max_tokens: int | list[int], vocab: int, prompt_seed: int = 0, **kwargs) -> list[EngineRequest]:
    generator = torch.Generator().manual_seed(prompt_seed)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(lens)
    return [
        EngineRequest(f"r{i}", tuple(torch.randint(1, vocab, (n,), generator=generator).tolist()), budget, **kwargs)
        for i, (n, budget) in enumerate(zip(lens, budgets))
    ]
