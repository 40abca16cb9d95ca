"""One interface per DSA operation, and `KernelSet`, the record of one implementation of them all.

A backend (a model family's, model_workers/models/) calls these and nothing below them, so a kernel set can be
swapped by name (`--attention-backend`, registry.py) without touching a model, a cache or the engine. Shapes:
T query rows, H heads, K keys of a request, k selected keys, W stored row width, E_local experts held here.
Stored key rows are what a cache holds (plain float rows, or FP8 bytes); `KeyFormat` says how to read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KeyFormat(Protocol):
    """How a cache layer stores one token's keys: `dim` values as `width` elements of `store_dtype`."""

    @property
    def dim(self) -> int: ...

    @property
    def width(self) -> int: ...

    @property
    def store_dtype(self) -> torch.dtype: ...

    @property
    def bytes_per_token(self) -> int: ...

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, dim] computed keys (after RoPE) -> [T, width] stored rows."""

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., width] stored rows -> [..., dim] values in `dtype`."""


class RowCodecs(Protocol):
    """FP8 row encode / decode: the key formats a cache can store (docs/kv_cache.md, 'FP8 layout')."""

    def plain(self, dim: int, dtype: torch.dtype) -> KeyFormat:
        """Rows kept as they are, in a float dtype."""

    def fp8(self, quantized_dim: int, plain_dim: int) -> KeyFormat:
        """The first `quantized_dim` values in FP8 e4m3 with a float32 scale per 128, the rest bf16."""


class IndexerLogits(Protocol):
    def __call__(self, index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor,
                 key_format: KeyFormat) -> torch.Tensor:
        """score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]): index_q [T, H, D], index_weights [T, H] (scales folded
        in), keys [K, W] stored rows -> [T, K] float32."""


class TopkSelection(Protocol):
    """Keys are read where the cache keeps them: `store` [S, W] stored rows, `slots` the rows of a request's key
    positions 0..K-1 (so a kernel reads the pages in place, no gathered copy)."""

    def causal(self, index_q: torch.Tensor, index_weights: torch.Tensor, store: torch.Tensor, slots: torch.Tensor,
               query_positions: torch.Tensor, topk: int, key_format: KeyFormat,
               deterministic: bool = False) -> torch.Tensor:
        """One request: slots [K], query_positions [T] -> [T, min(topk, K)] key positions by indexer score among
        those <= the query's, -1 where fewer; a query with at most `topk` causal keys takes all of them.
        `deterministic`: ties to the earlier key, fixed tiles (the torch reference's rule)."""

    def batched(self, index_q: torch.Tensor, index_weights: torch.Tensor, store: torch.Tensor, slots: torch.Tensor,
                query_positions: torch.Tensor, topk: int, key_format: KeyFormat) -> torch.Tensor:
        """B requests of a few rows each (decode, verification): index_q [B, n, H, D], index_weights [B, n, H],
        slots [B, K] (request b's positions 0..K_b-1 first; slots past K_b lie past every query and are never
        picked), query_positions [B, n] (-1 = padding row) -> [B, n, min(topk, K)] key positions."""


class SparseMLA(Protocol):
    """Absorbed MLA over selected keys: score = scale · (q_latent · c_kv + q_pe · k_pe), softmax over the k keys,
    out = Σ p · c_kv. q_latent [T, H, C], q_pe [T, H, R], key_rows [S, W] stored rows, key_ids [T, k] rows of
    key_rows (-1 = none) -> [T, H, C] in q_latent's dtype."""

    def prefill(self, q_latent: torch.Tensor, q_pe: torch.Tensor, key_rows: torch.Tensor, key_ids: torch.Tensor,
                scale: float, key_format: KeyFormat) -> torch.Tensor:
        """Many query rows per request."""

    def decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, key_rows: torch.Tensor, key_ids: torch.Tensor,
               scale: float, key_format: KeyFormat) -> torch.Tensor:
        """A few query rows per request (decode, verification, drafts)."""


class ExpertWeights(Protocol):
    """A MoE layer's routed experts held by this process (models/common/layers.py `Experts`)."""

    gate_up_proj: torch.Tensor  # [E_local, 2I, hidden]
    down_proj: torch.Tensor  # [E_local, hidden, I]
    expert_ids: range  # global ids of the experts held here
    swiglu_limit: float | None
    training: bool


class ExpertLoop(Protocol):
    def sum(self, experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], expert_ids (global, -1 = none) and weights [T, k] -> Σ_k weight · expert(x) over the
        experts held here [T, hidden], each row's terms added in expert-id order."""

    def slots(self, experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        """The same terms unsummed [T, k, hidden]: slot j = weight_j · expert_j(x), 0 where not held here."""

    def add_in_expert_order(self, slots: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """slots [T, k, hidden] -> [T, hidden] added in expert-id order: `sum`'s bits wherever each expert ran."""


@dataclass(frozen=True)
class KernelSet:
    """One implementation of every operation, by name (`--attention-backend`)."""

    name: str
    indexer_logits: IndexerLogits
    topk: TopkSelection
    sparse_mla: SparseMLA
    rows: RowCodecs
    experts: ExpertLoop
