"""What the router sends to a CP worker each step, and what comes back. Plain data: no model code, no Ray.

Steps run in lockstep: every rank receives one `StepPlan` per step holding its shard of the CP prefill
batch (if any) and its own decode batch (requests it owns). Heavy tensors (KV, hidden states) never travel
in these objects; they move over the process group inside the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_router.metadata import CPMetadata

NEXT_ID_SAMPLED = -1  # in `next_ids_local`: "the token the target samples for this request goes here"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # seeds the request's generator: same seed, same tokens, on every rank

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class PrefillRequest:
    """One request of a prefill batch, identical on every rank (stream order = order in the batch)."""

    request_id: str
    owner_rank: int  # cp_rank that keeps this request's KV and decodes it
    sampling: SamplingParams = SamplingParams()


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


@dataclass(frozen=True)
class StepPlan:
    prefill: PrefillShard | None = None
    decode: tuple[DecodeItem, ...] = ()
    return_logits: bool = False  # ship full-vocabulary logits back (tests, debugging)


@dataclass
class RequestOutput:
    """Result for one request, reported by its owner only."""

    request_id: str
    token_id: int  # sampled next token
    logits: torch.Tensor | None = None  # [vocab] float32, when the plan asked for them
    draft_token_id: int | None = None  # MTP greedy draft for the token after `token_id` (prefill only)
    draft_logits: torch.Tensor | None = None  # [vocab] float32, when the plan asked for them
    mtp_topk_positions: torch.Tensor | None = None  # [L_extend, k] int64 key positions, -1 padded (index sharing)


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
