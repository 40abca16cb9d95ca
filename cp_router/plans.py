"""What the router sends to a CP worker each step, and what comes back. Plain data: no model code, no Ray.

Steps run in lockstep: every rank receives one `StepPlan` per step holding its shard of the CP prefill
batch (if any) and its own decode batch (requests it owns). Heavy tensors (KV, hidden states) never travel
in these objects; they move over the process group inside the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_router.cp.metadata import CPMetadata

NEXT_ID_SAMPLED = -1  # in `next_ids_local`: "the token the target samples for this request goes here"


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (the one definition; the engine and the workers share it)."""

    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # the request's counter-based random stream: same seed, same tokens, whatever the batch
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_tokens: int = 0  # EOS and stop ids are blocked before this many generated tokens
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and k top alternatives

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "None or >= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class PrefillRequest:
    """One request of a prefill batch, identical on every rank (stream order = order in the batch)."""

    request_id: str
    owner_rank: int  # cp_rank that keeps this request's KV and decodes it
    sampling: SamplingParams = SamplingParams()
    final_chunk: bool = True  # False: more prompt chunks follow, every rank of the batch keeps the pages
    num_generated: int = 0  # prompt tail that is output recomputed after preemption (RNG index, min_tokens)


@dataclass(frozen=True)
class PrefillShard:
    """One rank's share of a prefill batch.

    `meta` describes the whole batch (shared by every rank); `meta.cp_size == 1` is the non-CP path that
    the owner runs alone, without collectives. Token rows are this rank's logical rows in local order.
    After the batch every rank but a request's owner frees that request's pages.
    """

    requests: tuple[PrefillRequest, ...]
    meta: CPMetadata
    shard_index: int  # which of meta's cp_size shards: the worker's cp_rank under CP, 0 on the non-CP path
    token_ids_local: torch.Tensor  # [T_logical] int64
    next_ids_local: torch.Tensor  # [T_logical] int64 MTP input t_{i+1}; NEXT_ID_SAMPLED where sampled


@dataclass(frozen=True)
class DecodeItem:
    request_id: str
    token_id: int  # appended at the request's next position; the step samples the token after it
    num_generated: int = 0  # output tokens so far, `token_id` included (RNG index, min_tokens)
    max_new: int = 1  # tokens the request may still emit (it ends there); a stop id / EOS ends it earlier


@dataclass(frozen=True)
class StepPlan:
    prefill: PrefillShard | None = None
    decode: tuple[DecodeItem, ...] = ()
    return_logits: bool = False  # ship full-vocabulary logits back (tests, debugging)
    free: tuple[str, ...] = ()  # requests whose pages this rank drops before anything else (abort, preempt)
    num_steps: int = 1  # decode steps run inside this one call (the router saves Ray round trips)
    num_speculative_steps: int = 0  # k MTP draft tokens verified per decode step (0: plain decode)


@dataclass
class RequestOutput:
    """Result for one request, reported by its owner only."""

    request_id: str
    token_id: int  # sampled next token
    logits: torch.Tensor | None = None  # [vocab] float32, when the plan asked for them
    draft_token_id: int | None = None  # MTP greedy draft for the token after `token_id` (prefill only)
    draft_logits: torch.Tensor | None = None  # [vocab] float32, when the plan asked for them
    mtp_topk_positions: torch.Tensor | None = None  # [L_extend, k] int64 key positions, -1 padded (index sharing)
    token_ids: list[int] = field(default_factory=list)  # every token emitted this call, `token_id` last
    logprobs: list[tuple] = field(default_factory=list)  # per emitted token (id, logprob, ((id, logprob), ...))
    drafted: int = 0  # draft tokens proposed this call
    accepted_per_position: list[int] = field(default_factory=list)  # [k] accepted drafts at draft position j


@dataclass
class StepResult:
    cp_rank: int
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    compute_s: float = 0.0  # step wall time minus time inside collectives
    cpu_s: float = 0.0  # CPU time of the worker process during the step (robust to other load on the host)
    comm_s: float = 0.0
    comm_bytes: int = 0  # bytes received from other ranks by all collectives of the step
    kv_comm_bytes: int = 0  # part of comm_bytes moved by the per-layer KV / indexer-key gathers
    num_collectives: int = 0
    free_pages: int = 0  # the rank's free KV pages after the step
    prefill_phase_s: dict[str, float] = field(default_factory=dict)  # prefill time by phase (PhaseClock)
    peak_rss_bytes: int = 0  # the worker process's peak resident memory so far
    decode_model_s: dict[str, float] = field(default_factory=dict)  # decode forwards: plain / draft / verify
    decode_steps: dict[str, int] = field(default_factory=dict)  # decode steps run: plain / speculative
