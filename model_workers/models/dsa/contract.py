"""The DSA family's backend contract: the one seam between its model and everything that stores keys or talks to
other processes.

The model computes projections; a backend decides where keys live (a paged cache, an in-memory batch
for training, a cache filled from an all-gather under context parallelism) and which kernel set runs top-k
selection and sparse attention (model_workers/kernels/). The model never imports torch.distributed:
a context-parallel backend gathers keys inside `store_kv` and the model does not know; an expert-parallel
one sends a MoE layer's rows to the ranks holding their experts inside `routed_experts`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Contract, per decoder layer `layer_id` (target layers 0..N-1, MTP layers N.. after them).

    Row order: every `[T, ...]` tensor holds the rows of this process's query tokens, in the order the
    caller's batch description gives them. Key indices returned by `select_topk` are opaque key ids
    (cache slots for paged backends); -1 marks "no key" and is never attended.
    """

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        """Make this batch's keys visible to every query of the batch.

        latent [T, kv_lora_rank + qk_rope_head_dim] (c_kv ‖ roped k_pe); index_key [T, index_head_dim]
        (roped, normed indexer key) or None on layers that reuse another layer's top-k.
        """

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        """Whether `select_topk` of this layer needs the indexer's queries and weights. A backend answers False
        only when its selection cannot depend on them (no query of the batch has more than `topk` causal keys,
        so each takes all of them; or the layer reuses a recorded selection); the layer then skips their
        projections and passes None for both."""

    def select_topk(
        self, layer_id: int, index_q: torch.Tensor | None, index_weights: torch.Tensor | None, topk: int
    ) -> torch.Tensor:
        """Top-k keys per query by the lightning-indexer score, causal by global position, within the request.

        index_q [T, H_idx, D_idx] (roped); index_weights [T, H_idx] float32 (already scaled by H_idx^-0.5
        and D_idx^-0.5 folded by the caller as documented in `indexer.py`); both None when
        `needs_index_scores` said False. Returns key ids [T, k'] int64, k' <= topk, -1 padded when a query has
        fewer causal keys than k'. The caller only reads the result.
        """

    def attend(
        self, layer_id: int, q_latent: torch.Tensor, q_pe: torch.Tensor, topk_ids: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Absorbed-MLA sparse attention over the selected keys.

        q_latent [T, H, kv_lora_rank] (q_nope folded through W_UK), q_pe [T, H, rope]; topk_ids [T, k'].
        score = scale·(q_latent·c_kv + q_pe·k_pe); returns softmax-weighted c_kv [T, H, kv_lora_rank].
        """

    def routed_experts(
        self, layer_id: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts
    ) -> torch.Tensor:
        """Σ_k weights · expert_k(x) over every routed expert, wherever it is held.

        x [T, hidden] (post-attention normed rows); expert_ids [T, k] global ids, weights [T, k] float32;
        `experts` the layer's `Experts` module (the experts held by this process). Returns [T, hidden].
        Without expert parallelism: `experts(x, expert_ids, weights)`.
        """
