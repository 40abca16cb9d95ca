"""The router: places requests on CP ranks and sends every rank its plan. Never touches model tensors.

For a prefill batch it builds the CP metadata (strategy x impl), picks each request's owner (the least
loaded rank by KV tokens held) and sends every rank only its token ids plus the batch metadata. A batch
too short to split runs without CP on one owner. Decode steps run in lockstep: each rank gets one plan
with the requests it owns. Runs as a Ray actor (cluster/launch.py) or in-process over worker handles.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import ray
import torch

from cp_router.cp.metadata import CPMetadata, build_cp_metadata
from cp_router.cp.padding import CP_IMPLS, IMPL_LEGACY
from cp_router.plans import DecodeItem, PrefillRequest, PrefillShard, RequestOutput, SamplingParams
from cp_router.plans import StepPlan, StepResult
from cp_router.prefill_batch import prefill_shards
from cp_router.cp.strategies import STRATEGY_INTERLEAVE, can_split, get_strategy


@dataclass
class PrefillReport:
    request_ids: list[str]  # batch order
    outputs: dict[str, RequestOutput]  # per request, from its owner
    ranks: list[StepResult]  # one per rank that ran (a single one on the non-CP path)
    wall_s: float
    cp_size_used: int  # meta.cp_size: 1 on the non-CP path
    per_rank_logical_token: tuple[int, ...]


class Router:
    def __init__(self, workers: list, cp_size: int, strategy: str | None, impl: str, enabled: bool = True):
        if len(workers) != cp_size:
            raise ValueError(f"cp_size={cp_size} but {len(workers)} workers were given")
        self.workers, self.cp_size = list(workers), cp_size
        self.strategy, self.impl, self.enabled = strategy, impl, enabled and cp_size > 1
        self.owner_of: dict[str, int] = {}
        self.tokens_of: dict[str, int] = {}  # KV tokens each request holds on its owner
        self._ids = itertools.count()

    def prefill(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        strategy: str | None = None,
        impl: str | None = None,
        return_logits: bool = False,
    ) -> PrefillReport:
        """One prefill batch (requests in stream order); strategy / impl override the engine's per batch."""
        strategy, impl = self._layout(strategy, impl)
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        lens = [len(p) for p in prompts]
        if min(lens, default=0) < 1 or len(samplings) != len(prompts):
            raise ValueError(f"prompts need >= 1 token each and one SamplingParams each, got lens {lens}")
        use_cp = self.enabled and can_split(lens, self.cp_size, strategy)
        if use_cp:
            meta = build_cp_metadata(lens, [0] * len(lens), self.cp_size, strategy, impl)
            ranks = list(range(self.cp_size))
        else:  # one rank alone, no padding, no collectives
            meta = build_cp_metadata(lens, [0] * len(lens), 1, STRATEGY_INTERLEAVE, IMPL_LEGACY)
            ranks = [self._least_loaded()]
        requests = self._new_requests(lens, samplings, None if use_cp else ranks[0])
        shards = prefill_shards(requests, prompts, meta)
        start = time.perf_counter()
        try:
            plans = {r: StepPlan(prefill=shards[i], return_logits=return_logits) for i, r in enumerate(ranks)}
            results = self._step(plans)
        except Exception:  # ray.get returned only after every rank finished: free whatever a rank still holds
            request_ids = [req.request_id for req in requests]
            ray.get([self.workers[r].free.remote(request_ids) for r in ranks])
            for request_id in request_ids:
                self.owner_of.pop(request_id), self.tokens_of.pop(request_id)
            raise
        outputs = {rid: out for r in results for rid, out in r.outputs.items()}
        wall_s = time.perf_counter() - start
        request_ids = [req.request_id for req in requests]
        return PrefillReport(request_ids, outputs, results, wall_s, meta.cp_size, meta.per_rank_logical_token)

    def decode(self, tokens: dict[str, int], return_logits: bool = False) -> dict[str, RequestOutput]:
        """One lockstep decode step: every owner appends its requests' tokens and samples the next ones."""
        per_rank: dict[int, list[DecodeItem]] = {}
        for request_id, token_id in tokens.items():
            per_rank.setdefault(self.owner_of[request_id], []).append(DecodeItem(request_id, token_id))
            self.tokens_of[request_id] += 1
        plans = {r: StepPlan(decode=tuple(items), return_logits=return_logits) for r, items in per_rank.items()}
        results = self._step(plans)
        return {rid: out for r in results for rid, out in r.outputs.items()}

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_ids=(),
        strategy: str | None = None,
        impl: str | None = None,
    ) -> list[dict]:
        """Prefill all prompts as one batch, then decode them together until max_tokens or a stop id."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        report = self.prefill(prompts, sampling, strategy, impl)
        request_ids = report.request_ids
        out = {rid: [report.outputs[rid].token_id] for rid in request_ids}
        try:
            active = {rid: toks[-1] for rid, toks in out.items() if toks[-1] not in stop_ids and max_tokens > 1}
            while active:
                for rid, result in self.decode(active).items():
                    out[rid].append(result.token_id)
                active = {r: out[r][-1] for r in active if out[r][-1] not in stop_ids and len(out[r]) < max_tokens}
        finally:
            self.release(request_ids)
        return [self._result(out[rid], len(p), stop_ids) for rid, p in zip(request_ids, prompts)]

    def release(self, request_ids: list[str]) -> None:
        """Frees the requests' pages on their owners and forgets them."""
        per_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            per_rank.setdefault(self.owner_of.pop(rid), []).append(rid)
            self.tokens_of.pop(rid)
        ray.get([self.workers[r].free.remote(rids) for r, rids in per_rank.items()])

    def owners(self) -> dict[str, int]:
        return dict(self.owner_of)

    def free_pages(self) -> list[int]:
        return ray.get([w.free_pages.remote() for w in self.workers])

    def _layout(self, strategy: str | None, impl: str | None) -> tuple[str, str]:
        strategy, impl = strategy or self.strategy or STRATEGY_INTERLEAVE, impl or self.impl
        get_strategy(strategy)  # one-line error naming the allowed strategies
        if impl not in CP_IMPLS:
            raise ValueError(f"cp_impl must be one of {CP_IMPLS}, got {impl!r}")
        return strategy, impl

    def _least_loaded(self) -> int:
        load = [0] * self.cp_size
        for rid, owner in self.owner_of.items():
            load[owner] += self.tokens_of[rid]
        return min(range(self.cp_size), key=lambda r: (load[r], r))

    def _new_requests(
        self, lens: list[int], samplings: list[SamplingParams], fixed_owner: int | None
    ) -> tuple[PrefillRequest, ...]:
        """Names the requests and records their owners: `fixed_owner`, or the least loaded rank at the time."""
        requests = []
        for length, sampling in zip(lens, samplings):
            request_id = f"req-{next(self._ids)}"
            owner = self._least_loaded() if fixed_owner is None else fixed_owner
            self.owner_of[request_id], self.tokens_of[request_id] = owner, length
            requests.append(PrefillRequest(request_id, owner, sampling))
        return tuple(requests)

    def _step(self, plans: dict[int, StepPlan]) -> list[StepResult]:
        return ray.get([self.workers[cp_rank].step.remote(plan) for cp_rank, plan in plans.items()])

    @staticmethod
    def _result(tokens: list[int], prompt_tokens: int, stop_ids) -> dict:
        finish = "stop" if tokens[-1] in stop_ids else "length"
        return {"token_ids": tokens, "prompt_tokens": prompt_tokens, "finish_reason": finish}
