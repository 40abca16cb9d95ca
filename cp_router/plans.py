"""What the engine sends to a rank worker each step, and what comes back. Plain data: no model code, no Ray.

Steps run in lockstep: every rank that has work receives one `StepPlan` holding its shard of the prefill batch
(if any) and its own decode batch (requests it owns). The scheduler owns the KV pages: every plan carries the
page tables the rank writes into, so a rank never allocates. Heavy tensors (KV, hidden states) travel in these
objects only as a prefill/decode hand-off (cp_router/handoff.py); within a group they move over the process group
inside the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_router.cp.metadata import RankMetadata
from cp_router.handoff import ImportItem, RequestHandoff
from cp_router.sampling import FinishReason, SamplingParams
from cp_router.cp.wire import TensorsAsNumpy

NEXT_ID_SAMPLED = -1  # in `next_ids_local`: "the token the target samples for this request goes here"


@dataclass(frozen=True)
class PrefillRequest:
    """One request of a prefill batch, identical on every rank (stream order = order in the batch)."""

    request_id: str
    owner_rank: int  # cp_rank that keeps this request's KV and decodes it
    sampling: SamplingParams = SamplingParams()
    final_chunk: bool = True  # False: more prompt chunks follow
    num_generated: int = 0  # prompt tail that is output recomputed after preemption (RNG index, min_tokens)
    # final chunk of a request with penalties, or a recomputed constrained one: its context (prompt + outputs)
    context_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None  # k >= 0: the owner scores the chunk's prompt tokens (None: off / recompute)
    # A recomputed request (preempted, or its ranks lost): the output token it already streamed after this
    # context. It stands in for the sample (the MTP layer and the history take it) and nothing new is emitted,
    # so decoding goes on exactly where it stopped. None: the final chunk samples the next token.
    resume_token: int | None = None
    # Prefix caching, a family with bounded per-request state (DeepSeek-V4): this chunk ends on a hit boundary;
    # every rank that runs it keeps a copy of the request's state there, under the page ending there.
    snapshot_state: bool = False
    # Prefill/decode disaggregation: after its final chunk the owner hands the request off (StepResult.handoffs)
    # instead of keeping it for decode.
    handoff: bool = False


@dataclass(frozen=True)
class PrefillShard(TensorsAsNumpy):
    """One rank's share of a prefill batch (its tensors cross the Ray call as numpy arrays: cp_router/cp/wire.py).

    `meta` is this rank's slice of the batch's CP metadata; `meta.cp_size == 1` is the non-CP path: the owner
    runs its own requests of the batch whole, without collectives. Token rows are this rank's logical rows in
    local order. `page_tables[s]` are this rank's pages of request s, covering its prefix and this chunk.
    """

    requests: tuple[PrefillRequest, ...]
    meta: RankMetadata
    token_ids_local: torch.Tensor  # [T_logical] int64
    next_ids_local: torch.Tensor  # [T_logical] int64 MTP input t_{i+1}; NEXT_ID_SAMPLED where sampled
    page_tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DecodeItem:
    request_id: str
    token_id: int  # appended at position `num_cached`; the step samples the token after it
    num_cached: int  # KV positions 0..num_cached-1 are in the cache
    pages: tuple[int, ...]  # the owner's pages of the request: room for every token this call may write
    num_generated: int = 0  # output tokens so far, `token_id` included (RNG index, min_tokens)
    max_new: int = 1  # tokens the request may still emit (it ends there); a stop id / EOS ends it earlier


@dataclass(frozen=True)
class StepPlan:
    prefill: PrefillShard | None = None
    decode: tuple[DecodeItem, ...] = ()
    return_logits: bool = False  # ship full-vocabulary logits back (tests, debugging)
    free: tuple[str, ...] = ()  # requests whose rank-side state (MTP draft state) is dropped before anything else
    drop_snapshots: tuple[int, ...] = ()  # pages whose state snapshot is dropped first: evicted (prefix caching)
    num_steps: int = 1  # decode steps run inside this one call (the engine saves Ray round trips)
    num_speculative_steps: int = 0  # k MTP draft tokens verified per decode step (0: plain decode)
    # Time this step's prefill by phase (`StepResult.prefill_phase_s`; `bench prefill`). Off when serving: the
    # hooks cost about 2 ms a prefill step (13% of a one-request short prefill on the bench VM).
    time_prefill_phases: bool = False
    # Expert parallelism (lockstep): rows each rank brings to this step's prefill forward (() = none / no EP),
    # and whether the group decodes this step (a rank without requests of its own joins with zero rows).
    group_prefill_rows: tuple[int, ...] = ()
    group_decode: bool = False
    imports: tuple[ImportItem, ...] = ()  # hand-offs written here before the decode batch (disaggregation)


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
    logprobs: list[tuple] = field(default_factory=list)  # per emitted token (id, logprob, ((id, logprob), ...), rank)
    prompt_logprobs: list[tuple] = field(default_factory=list)  # per chunk row predicting a prompt token: as above
    finish_reason: FinishReason | None = None  # decided by the rank that sampled (`SamplingParams.finish_reason`)
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
    comm_bytes_by_tag: dict[str, int] = field(default_factory=dict)  # comm_bytes by CommStats tag
    num_collectives: int = 0
    prefill_phase_s: dict[str, float] = field(default_factory=dict)  # by phase, when the plan asked (PhaseClock)
    peak_rss_bytes: int = 0  # the worker process's peak resident memory so far
    decode_model_s: dict[str, float] = field(default_factory=dict)  # decode forwards: plain / draft / verify
    decode_steps: dict[str, int] = field(default_factory=dict)  # decode steps run: plain / speculative
    grammar_mask_s: float = 0.0  # structured outputs: seconds spent computing grammar masks, and how many
    grammar_masks: int = 0
    handoffs: dict[str, RequestHandoff] = field(default_factory=dict)  # prefilled requests handed off (owner)
    handoff_s: float = 0.0  # seconds reading out hand-offs (prefill group) or writing them (decode group)
