"""Multi-head latent attention (MLA) with the DSA lightning indexer, in the absorbed form.

The cache holds, per token, c_kv ‖ k_pe (the latent) and the indexer key. Queries are folded through
W_UK (from kv_b_proj) so attention runs over the latent directly; the output is unfolded through W_UV.
Neither prefill nor decode ever expands the cache to per-head keys.
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.models.dsa.contract import AttentionBackend
from model_workers.models.dsa.config import ModelConfig
from model_workers.models.common.layers import RMSNorm
from model_workers.models.common.linear import Linear
from model_workers.models.common.rope import attention_softmax_scale, rotate_half_split, rotate_interleaved


class Indexer(nn.Module):
    """q_idx = wq_b(q_resid), k_idx = LayerNorm(wk(x)), weights = weights_proj(x); RoPE on the first rope dims."""

    timing_phase = "indexer"  # model_workers/phase_clock.py

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, bias=False)
        self.rotate = rotate_interleaved if config.interleaved_index_rope else rotate_half_split
        # Σ_h w_h·H^-0.5 · ReLU(q·k·D^-0.5) == Σ_h (w_h·H^-0.5·D^-0.5) · ReLU(q·k): fold both scales into w.
        self.weight_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, with_queries: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """x [T, hidden], q_resid [T, q_lora] -> (q [T, H_idx, D_idx], k [T, D_idx], weights [T, H_idx] fp32);
        without `with_queries` (the backend selects without scores) only k, the cached part, and (None, k, None)."""
        k = self.k_norm(self.wk(x))  # [T, D_idx]
        k = torch.cat([self.rotate(k[..., : self.rope_dim], cos, sin), k[..., self.rope_dim :]], dim=-1)
        if not with_queries:
            return None, k, None
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)  # [T, H_idx, D_idx]
        q = torch.cat([self.rotate(q[..., : self.rope_dim], cos, sin), q[..., self.rope_dim :]], dim=-1)
        weights = self.weights_proj(x.float() if self.weights_proj.weight.dtype == torch.float32 else x)
        return q, k, weights.float() * self.weight_scale


class MLAttention(nn.Module):
    timing_phase = "attention_total"  # model_workers/phase_clock.py: indexer, top-k, KV store excluded

    def __init__(self, config: ModelConfig, has_indexer: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.index_topk = config.index_topk
        bias = config.attention_bias
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, config.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size, bias=bias)
        self.indexer = Indexer(config) if has_indexer else None
        self.scale = attention_softmax_scale(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        layer_id: int,
        shared_topk: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (out [T, hidden], top-k key ids [T, k'] for layers that share them)."""
        num_tokens = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora]
        q = self.q_b_proj(q_resid).view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope_dim], rotate_interleaved(q[..., self.nope_dim :], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)  # [T, kv_lora + rope]
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_pe = rotate_interleaved(kv[:, self.kv_lora_rank :], cos, sin)
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [T, kv_lora + rope]

        index_q = index_w = index_k = None
        if self.indexer is not None:
            # Training (DSA recipe): the indexer learns only from its KL loss, so its inputs are detached.
            index_in, index_resid = (x.detach(), q_resid.detach()) if self.training else (x, q_resid)
            scored = backend.needs_index_scores(layer_id, self.index_topk)  # else every query takes all its keys
            index_q, index_k, index_w = self.indexer(index_in, index_resid, cos, sin, with_queries=scored)
        backend.store_kv(layer_id, latent, index_k)
        if self.indexer is not None:
            topk_ids = backend.select_topk(layer_id, index_q, index_w, self.index_topk)
        elif shared_topk is not None:
            topk_ids = shared_topk
        else:
            raise ValueError(f"layer {layer_id} reuses top-k ('shared') but no earlier layer produced one")

        w_uk, w_uv = self._absorbed_weights()
        # per-head products as bmm over heads: the bits of einsum "thn,hnc->thc" / "thc,hvc->thv", without its
        # dispatch (bf16 on CPU: 40 -> 26 us a call at T = 1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora]
        out_latent = backend.attend(layer_id, q_latent, q_pe, topk_ids, self.scale)  # [T, H, kv_lora]
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim)), topk_ids

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora] as views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]
