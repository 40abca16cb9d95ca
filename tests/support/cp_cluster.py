"""Helpers of the CP cluster tests: CP groups reused per cp_size, prefills through the engine with a step
observer that reads each rank's view of the prefill step, the single-process expected outputs, prompts."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers, run_all
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import CPGroup, engine_cpus, launch_group, start_ray
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.loader import load_model
from model_workers.checkpoint.model_dir import read_model_spec
from model_workers.models.dsa.cache import PagedKVCache
from model_workers.page_table import PageTable
from model_workers.precision import compute_dtype, set_draft_precision
from model_workers.runner import ExtendItem, ModelRunner
from model_workers.spec import RankSpec

NUM_PAGES, PAGE_SIZE = 64, 8  # 512 token slots per rank


def make_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=generator).tolist() for n in lens]


def cache_rows(cache: PagedKVCache, table: PageTable) -> dict[str, list[torch.Tensor | None]]:
    """Same layout as `CPWorker.export_kv`: per cache layer, the rows of positions 0..n-1."""
    return cache.rows(table)


@dataclass
class Expected:
    logits: torch.Tensor  # [R, vocab] last-token logits
    draft_logits: torch.Tensor  # [R, vocab] MTP logits at each request's last token
    tokens: list[int]  # greedy
    kv: list[dict]  # per request, `cache_rows`


_EXPECTED: dict[tuple, Expected] = {}


def single_process(folder: Path, prompts: list[list[int]], dtype: torch.dtype = torch.float32,
                   kv_cache_dtype: str = "auto") -> Expected:
    """The plain single-process path (ModelRunner.extend + extend_mtp), independent of the CP code, with
    the workers' precision: bf16 weights computed in fp32 on a CPU without native bf16, the draft widened as a CPU
    rank widens it (precision.set_draft_precision), the KV cache in
    `kv_cache_dtype` (auto: as the weights are stored)."""
    key = (str(folder), dtype, kv_cache_dtype, tuple(map(tuple, prompts)))
    if key not in _EXPECTED:
        model = load_model(folder, dtype=compute_dtype(dtype, "cpu"), progress=False)  # as a CPU worker does
        set_draft_precision(model, "cpu")
        runner = ModelRunner(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype)
        tables = runner.standalone_tables([len(p) for p in prompts])
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
    """One CP group per cp_size, launched on first use and reloaded when another checkpoint / dtype is asked."""

    def __init__(self):
        self.groups: dict[int, CPGroup] = {}
        self.loaded: dict[int, tuple[str, str]] = {}

    def group(self, cp_size: int, folder: Path, dtype: str = "float32", ep_size: int = 1,
              kv_cache_dtype: str = "auto") -> CPGroup:
        """The group of `cp_size` ranks with this checkpoint, dtype, expert parallelism and KV format loaded."""
        wanted = (str(folder), dtype, ep_size, kv_cache_dtype)
        if cp_size not in self.groups:
            cp = ResolvedCPConfig(enabled=True, cp_size=cp_size, strategy="zigzag", impl="legacy", ep_size=ep_size)
            self.groups[cp_size] = launch_group(folder, cp, dtype, NUM_PAGES, PAGE_SIZE, kv_cache_dtype=kv_cache_dtype)
        elif self.loaded[cp_size] != wanted:
            workers = self.groups[cp_size].workers
            rank = RankSpec(read_model_spec(folder), dtype, NUM_PAGES, PAGE_SIZE, ep_size, kv_cache_dtype)
            ray.get([w.load.remote(rank) for w in workers])
        self.loaded[cp_size] = wanted
        return self.groups[cp_size]

    def engine(self, cp_size: int, folder: Path, strategy: str, impl: str, dtype: str = "float32", ep_size: int = 1,
               **options):
        """A fresh engine over the group's workers with this CP layout (return_logits on: tests read them)."""
        cp = ResolvedCPConfig(enabled=True, cp_size=cp_size, strategy=strategy, impl=impl, ep_size=ep_size)
        settings = dict(dtype=dtype, num_pages=NUM_PAGES, page_size=PAGE_SIZE, return_logits=True,
                        prefill_token_budget=NUM_PAGES * PAGE_SIZE,
                        enable_prefix_caching=False)  # CP prefill tests: each prompt prefilled whole, in one step
        options = EngineOptions(**{**settings, **options})
        return engine_over_workers(resolve_engine_spec(folder, cp, options),
                                   self.group(cp_size, folder, dtype, ep_size, options.kv_cache_dtype).workers)

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()


@contextlib.contextmanager
def ray_groups(cp_sizes: list[int]):
    """A local Ray sized for one group of each cp_size, and the `Cluster` of those groups; both torn down after."""
    start_ray(min_cpus=sum(engine_cpus(cp_size) for cp_size in cp_sizes))
    groups = Cluster()
    try:
        yield groups
    finally:
        groups.shutdown()
        ray.shutdown()


@dataclass
class PrefillRun:
    """Every rank's view of the prefill steps of one engine run, read by a step observer right after each step."""

    request_ids: list[str]
    outputs: dict = field(default_factory=dict)  # request id -> its owner's RequestOutput of the final chunk
    ranks: list = field(default_factory=list)  # StepResult of every rank that ran the (last) prefill step
    cp_size_used: int = 0
    per_rank_logical_token: tuple[int, ...] = ()
    collective_rows: int = 0  # rows every rank passed to each gather of the (last) prefill step
    owners: dict[str, int] = field(default_factory=dict)
    kv: dict[str, dict] = field(default_factory=dict)  # request id -> its owner's cache rows after the prefill
    held: list[list[str]] = field(default_factory=list)  # per rank: requests it keeps state of after the step
    prefill_steps: int = 0

    async def observe(self, step, results, workers) -> None:
        if step.prefill is None:
            return
        self.prefill_steps += 1
        shards = {r: plan.prefill for r, plan in step.plans.items() if plan.prefill is not None}
        self.ranks = sorted((r for r in results if r.cp_rank in shards), key=lambda r: r.cp_rank)
        self.cp_size_used = next(iter(shards.values())).meta.cp_size
        self.per_rank_logical_token = tuple(shards[r].meta.num_logical for r in sorted(shards))
        self.collective_rows = next(iter(shards.values())).meta.collective_rows
        for piece, owner in zip(step.prefill.pieces, step.prefill.owners):
            self.owners[piece.request_id] = owner
            self.outputs[piece.request_id] = next(r.outputs[piece.request_id] for r in results if r.cp_rank == owner)
            s = [r.request_id for r in shards[owner].requests].index(piece.request_id)  # in the owner's shard
            pages, tokens = shards[owner].page_tables[s], piece.prefix_len + piece.extend_len
            self.kv[piece.request_id] = await workers[owner].export_kv.remote(list(pages), tokens, piece.request_id)
        self.held = list(await asyncio.gather(*[w.held_requests.remote() for w in workers]))


def cp_prefill(engine, prompts: list[list[int]], max_tokens: int = 1) -> tuple[PrefillRun, list[dict]]:
    """Greedy requests through the engine (one prefill batch when the budget allows); the prefill as every rank
    saw it and the results. Afterwards the engine has drained: pages back, no rank state left."""
    requests = [EngineRequest(f"p{i}", tuple(p), max_tokens, temperature=0.0, ignore_eos=True)
                for i, p in enumerate(prompts)]
    run = PrefillRun([r.request_id for r in requests])

    async def observer(step, results):
        await run.observe(step, results, engine.workers)

    engine.add_step_observer(observer)
    results = run_all(engine, requests)
    asyncio.run(engine.drain())
    return run, results


def assert_kv_equal(actual: dict, expected: dict, atol: float) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:  # latent, index_keys (MLA); window, entries, index_keys (DeepSeek-V4)
        for layer, (got, want) in enumerate(zip(actual[name], expected[name])):
            assert (got is None) == (want is None), f"{name}[{layer}]"
            if got is not None and got.dtype == torch.uint8:  # FP8 rows: the stored bytes, bit for bit
                assert torch.equal(got, want), f"{name}[{layer}]: FP8 bytes differ in {int((got != want).sum())} places"
            elif got is not None:
                torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{name}[{layer}]: {m}")
