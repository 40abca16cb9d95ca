"""Helpers of the CP cluster tests: engines reused per cp_size, the single-process expected outputs, prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from cluster.config import ResolvedCPConfig
from cluster.launch import CPEngine, launch_engine
from model_workers.kv_cache import PagedKVCache, PageTable
from model_workers.checkpoint.loader import load_model
from model_workers.precision import compute_dtype
from model_workers.runner import ExtendItem, ModelRunner

NUM_PAGES, PAGE_SIZE = 64, 8  # 512 token slots per rank


def make_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=generator).tolist() for n in lens]


def cache_rows(cache: PagedKVCache, table: PageTable) -> dict[str, list[torch.Tensor | None]]:
    """Same layout as `CPWorker.export_kv`: per cache layer, the rows of positions 0..n-1."""
    slots = table.slots(0, table.num_tokens, cache.page_size)
    return {
        "latent": [layer[slots] for layer in cache.latent],
        "index_keys": [None if layer is None else layer[slots] for layer in cache.index_keys],
    }


@dataclass
class Expected:
    logits: torch.Tensor  # [R, vocab] last-token logits
    draft_logits: torch.Tensor  # [R, vocab] MTP logits at each request's last token
    tokens: list[int]  # greedy
    kv: list[dict]  # per request, `cache_rows`


_EXPECTED: dict[tuple, Expected] = {}


def single_process(folder: Path, prompts: list[list[int]], dtype: torch.dtype = torch.float32) -> Expected:
    """The plain single-process path (ModelRunner.extend + extend_mtp), independent of the CP code, with
    the workers' precision: bf16 weights computed in fp32 on a CPU without native bf16, bf16 KV cache."""
    key = (str(folder), dtype, tuple(map(tuple, prompts)))
    if key not in _EXPECTED:
        model = load_model(folder, dtype=compute_dtype(dtype, "cpu"), progress=False)  # as a CPU worker does
        runner = ModelRunner(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=dtype)
        tables = [PageTable() for _ in prompts]
        hidden = runner.extend([ExtendItem(t, p) for t, p in zip(tables, prompts)])  # [N, D]
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1  # [R]
        logits = model.logits(hidden[last])  # [R, vocab]
        tokens = logits.argmax(-1).tolist()
        next_ids = [ExtendItem(t, p[1:] + [tok]) for t, p, tok in zip(tables, prompts, tokens)]
        mtp_hidden = runner.extend_mtp(next_ids, hidden, [0] * len(prompts))
        draft_logits = model.mtp_logits(mtp_hidden[last])
        _EXPECTED[key] = Expected(logits, draft_logits, tokens, [cache_rows(runner.cache, t) for t in tables])
    return _EXPECTED[key]


class Cluster:
    """One engine per cp_size, launched on first use and reloaded when another checkpoint / dtype is asked."""

    def __init__(self):
        self.engines: dict[int, CPEngine] = {}
        self.loaded: dict[int, tuple[str, str]] = {}

    def engine(self, cp_size: int, folder: Path, dtype: str = "float32") -> CPEngine:
        if cp_size not in self.engines:
            cp = ResolvedCPConfig(enabled=True, cp_size=cp_size, strategy="zigzag", impl="legacy")
            self.engines[cp_size] = launch_engine(folder, cp, dtype, NUM_PAGES, PAGE_SIZE)
        elif self.loaded[cp_size] != (str(folder), dtype):
            workers = self.engines[cp_size].workers
            ray.get([w.load.remote(str(folder), dtype, NUM_PAGES, PAGE_SIZE) for w in workers])
        self.loaded[cp_size] = (str(folder), dtype)
        return self.engines[cp_size]

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


def cp_prefill(engine: CPEngine, prompts: list[list[int]], strategy: str, impl: str):
    """Prefill through the router, read each owner's KV and every rank's held requests, then release."""
    report = ray.get(engine.router.prefill.remote(prompts, strategy=strategy, impl=impl, return_logits=True))
    owners = ray.get(engine.router.owners.remote())
    kv = [ray.get(engine.workers[owners[rid]].export_kv.remote(rid)) for rid in report.request_ids]
    held = ray.get([w.held_requests.remote() for w in engine.workers])
    ray.get(engine.router.release.remote(report.request_ids))
    return report, kv, held, owners


def assert_kv_equal(actual: dict, expected: dict, atol: float) -> None:
    for name in ("latent", "index_keys"):
        for layer, (got, want) in enumerate(zip(actual[name], expected[name])):
            assert (got is None) == (want is None), f"{name}[{layer}]"
            if got is not None:
                torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{name}[{layer}]: {m}")
