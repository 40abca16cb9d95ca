"""Attention backend for training: a [B, S] batch of sequences held in memory, with autograd, no KV cache.

Dense mode (the warm-up) attends to every causal key; sparse mode attends to the indexer's top-k. In both
the indexer learns by KL divergence to the main attention's head-summed distribution (DeepSeek's DSA
recipe): the target is detached and the indexer's inputs are detached in the layer, so the KL gradient
reaches only the indexer. The same model layers run here and at inference; only this backend differs.
"""

from __future__ import annotations

import torch

from model_workers.kernels.torch.sparse_mla import sparse_mla_attention


class TrainingBackend:
    def __init__(self, batch_size: int, seq_len: int, sparse: bool):
        self.batch_size, self.seq_len, self.sparse = batch_size, seq_len, sparse
        self.latent: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.index_scores: dict[int, torch.Tensor] = {}
        self.kl_losses: list[torch.Tensor] = []
        positions = torch.arange(seq_len)
        self.future = positions[None, :] > positions[:, None]  # [S, S] True where key is after query

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        self.latent[layer_id] = latent  # [B*S, C + R]
        if index_key is not None:
            self.index_keys[layer_id] = index_key  # [B*S, D_idx]

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        return True  # the indexer learns from its scores (KL) on every batch

    def select_topk(self, layer_id: int, index_q: torch.Tensor, index_weights: torch.Tensor, topk: int) -> torch.Tensor:
        b, s = self.batch_size, self.seq_len
        q = index_q.float().view(b, s, *index_q.shape[1:])  # [B, S, H_idx, D_idx]
        k = self.index_keys[layer_id].float().view(b, s, -1)  # [B, S, D_idx]
        dots = torch.einsum("bqhd,bkd->bqhk", q, k).clamp_min(0)  # [B, S, H_idx, S]
        scores = torch.einsum("bqhk,bqh->bqk", dots, index_weights.float().view(b, s, -1))  # [B, S, S]
        scores = scores.masked_fill(self.future, float("-inf"))
        self.index_scores[layer_id] = scores
        if not self.sparse:
            return torch.empty(b * s, 0, dtype=torch.long)
        width = min(topk, s)
        picked = scores.detach().topk(width, dim=-1)  # [B, S, k]
        ids = picked.indices + (torch.arange(b) * s)[:, None, None]  # flattened key rows
        return torch.where(torch.isinf(picked.values), -1, ids).view(b * s, width)

    def routed_experts(self, layer_id: int, x, expert_ids, weights, experts) -> torch.Tensor:
        return experts(x, expert_ids, weights)  # training holds every expert

    def attend(self, layer_id: int, q_latent, q_pe, topk_ids: torch.Tensor, scale: float) -> torch.Tensor:
        if self.sparse:
            return self._sparse_attend(layer_id, q_latent, q_pe, topk_ids, scale)
        return self._dense_attend(layer_id, q_latent, q_pe, scale)

    def _dense_attend(self, layer_id: int, q_latent, q_pe, scale: float) -> torch.Tensor:
        b, s = self.batch_size, self.seq_len
        heads, latent_dim = q_latent.shape[1], q_latent.shape[2]
        keys = self.latent[layer_id].view(b, s, -1)  # [B, S, C + R]: the latent and the rope key, side by side
        queries = (torch.cat([q_latent, q_pe], dim=-1) * scale).view(b, s * heads, -1)  # [B, S*H, C + R]
        scores = torch.bmm(queries, keys.transpose(1, 2)).float().view(b, s, heads, s)  # [B, S, H, S]
        probs = scores.masked_fill(self.future[:, None, :], float("-inf")).softmax(-1)
        if layer_id in self.index_scores:
            target = probs.detach().sum(2)  # [B, S, S] head-summed
            self._add_kl(target / target.sum(-1, keepdim=True), self.index_scores.pop(layer_id))
        c_kv = keys[..., :latent_dim]  # [B, S, C]
        out = torch.bmm(probs.to(c_kv.dtype).view(b, s * heads, s), c_kv)  # [B, S*H, C]
        return out.view(b * s, heads, latent_dim)

    def _sparse_attend(self, layer_id: int, q_latent, q_pe, topk_ids, scale: float) -> torch.Tensor:
        latent = self.latent[layer_id]
        out = sparse_mla_attention(q_latent, q_pe, latent, topk_ids, scale, budget_bytes=1 << 40)
        if layer_id in self.index_scores:
            with torch.no_grad():  # the attention distribution over the selected keys, head-summed
                gathered = latent[topk_ids.clamp_min(0)]  # [T, k, C + R]
                c_kv, k_pe = gathered[..., : q_latent.shape[2]], gathered[..., q_latent.shape[2] :]
                scores = torch.einsum("thc,tkc->thk", q_latent, c_kv) + torch.einsum("thr,tkr->thk", q_pe, k_pe)
                scores = (scores.float() * scale).masked_fill((topk_ids < 0)[:, None, :], float("-inf"))
                target = scores.softmax(-1).sum(1)
                target = target / target.sum(-1, keepdim=True)  # [T, k]
            index_scores = self.index_scores.pop(layer_id).view(-1, self.seq_len)  # [T, S]
            local_ids = (topk_ids % self.seq_len).clamp_min(0)
            selected = index_scores.gather(1, local_ids).masked_fill(topk_ids < 0, float("-inf"))
            self._add_kl(target, selected)
        return out

    def _add_kl(self, target: torch.Tensor, index_scores: torch.Tensor) -> None:
        """KL(target || softmax(index_scores)) averaged over queries; -inf entries carry no mass."""
        has_mass = target > 0
        log_q = index_scores.float().log_softmax(-1).masked_fill(~has_mass, 0.0)  # no 0·inf in value or grad
        terms = target * (target.clamp_min(1e-30).log() - log_q)
        self.kl_losses.append(terms.sum(-1).mean())
