"""DeepSeek-V4 attention, the part every layer shares (../shared/deepseek_v4.md section 2.4): the q path
(low rank, weighted then per-head unweighted RMS norm, partial interleaved RoPE), the one shared K = V head,
attention over each query's own key rows with a per-head sink logit, the output's RoPE slice de-rotated at
the query position, and the grouped low-rank output projection.

A query sees its sliding window of raw entries and, on CSA / HCA layers, compressed entries: all visible
ones (HCA) or the lightning indexer's top-k (CSA). Which rows exist is the backend's business
(`V4AttentionBackend`); `attend_with_sinks` takes them per query, padded, with a validity mask.
Parameter names follow the checkpoint (`self_attn.q_a_proj`, `self_attn.sinks`, `self_attn.compressor...`).
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.model.layers import RMSNorm
from model_workers.model.rope import RotaryTable, rotate_pairs
from model_workers.model.v4_blocks import unweighted_rms
from model_workers.model.v4_compress import CSACompressor, HCACompressor, visible_entries
from model_workers.model.v4_config import CSA, HCA, SLIDING, V4Config


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [T, H, Dh]; keys [T, K, Dh] each query's key rows (also its values); valid [T, K] bool;
    sinks [H] (a logit per head in the softmax denominator, with no value) -> [T, H, Dh]."""
    logits = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale  # [T, H, K]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)  # [T, H, 1]
    combined = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]  # [T, H, K]
    return torch.einsum("thk,tkd->thd", probs, keys.float()).to(q.dtype)


class V4Attention(nn.Module):
    def __init__(self, config: V4Config, layer_type: str = SLIDING):
        super().__init__()
        heads, head_dim, groups = config.num_attention_heads, config.head_dim, config.o_groups
        self.num_heads, self.head_dim, self.rope_dim = heads, head_dim, config.qk_rope_head_dim
        self.o_groups, self.eps, self.scale = groups, config.rms_norm_eps, head_dim**-0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.o_a_proj = nn.Linear(heads * head_dim // groups, groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        if layer_type == CSA:
            self.compressor = CSACompressor(config, with_indexer=True)
        elif layer_type == HCA:
            self.compressor = HCACompressor(config)
        else:
            self.compressor = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, table: RotaryTable, backend,
                layer_id: int) -> torch.Tensor:
        """x [T, D] (normed collapsed streams), positions [T] global; `table` the layer's RoPE -> [T, D]."""
        cos, sin = table.for_positions(positions)
        q, q_residual = self.queries(x, cos, sin)
        keys, valid = backend.window_keys(layer_id, self.key_values(x, cos, sin))  # [T, W, Dh], [T, W]
        if self.compressor is not None:
            extra_keys, extra_valid = self.compressed_keys(x, q_residual, positions, table, backend, layer_id)
            keys, valid = torch.cat([keys, extra_keys], dim=1), torch.cat([valid, extra_valid], dim=1)
        return self.output(self.attend(q, keys, valid), cos, sin)

    def compressed_keys(self, x, q_residual, positions, table: RotaryTable, backend, layer_id: int):
        """The compressed entries each query attends -> keys [T, K, Dh], valid [T, K]: every visible entry (HCA)
        or the indexer's top-k of them (CSA)."""
        compressor = self.compressor
        entries = backend.compressed_entries(layer_id, compressor, table, *compressor.project(x))  # [n_s, Dh]
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            index_keys = backend.compressed_entries(layer_id, indexer, table, *indexer.project(x))  # [n_s, d_I]
            index_q, index_w = indexer.queries(x, q_residual, *table.for_positions(positions))
        widths = [min(indexer.topk, e.shape[0]) if indexer is not None else e.shape[0] for e in entries]
        keys = x.new_zeros((x.shape[0], max(widths, default=0), self.head_dim))
        valid = torch.zeros(keys.shape[:2], dtype=torch.bool, device=x.device)
        for s, rows in enumerate(backend.request_rows):
            if rows.numel() == 0 or widths[s] == 0:
                continue
            if indexer is None:
                keys[rows, : widths[s]] = entries[s].to(keys.dtype)
                valid[rows, : widths[s]] = visible_entries(positions[rows], widths[s], compressor.rate)
            else:
                picked = indexer.select(index_q[rows], index_w[rows], index_keys[s], positions[rows])  # [t, k]
                keys[rows, : widths[s]] = entries[s][picked.clamp_min(0)].to(keys.dtype)
                valid[rows, : widths[s]] = picked >= 0
        return keys, valid

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (normed) -> (q [T, H, Dh] roped, q_residual [T, Q]: the normed q-lora the indexer reads)."""
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim), self.eps)
        return self._rope(q, cos, sin), q_residual

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the shared K = V row of each token [T, Dh], normed and roped at its position."""
        return self._rope(self.kv_norm(self.kv_proj(x)), cos, sin)

    def output(self, attended: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """attended [T, H, Dh] -> de-rotate the RoPE slice at the query position -> grouped low-rank -> [T, D]."""
        attended = self._rope(attended, cos, sin, inverse=True)
        num_rows = attended.shape[0]
        grouped = attended.reshape(num_rows, self.o_groups, -1)  # [T, G, (H/G)·Dh]: consecutive heads per group
        weight = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, R_o, (H/G)·Dh]
        low_rank = torch.einsum("tgi,gri->tgr", grouped, weight).reshape(num_rows, -1)  # [T, G·R_o]
        return self.o_b_proj(low_rank)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return attend_with_sinks(q, keys, valid, self.sinks, self.scale)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE on the trailing `qk_rope_head_dim` channels ([nope | rope]); cos/sin [T, r/2]."""
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :]
        return torch.cat([nope, rotate_pairs(rope, cos, sin, inverse)], dim=-1)


def sliding_window_keys(kv: torch.Tensor, positions: torch.Tensor, window: int,
                        first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K = V rows kv [n, Dh] of positions first, first+1, ... -> each query's window (p-W, p]:
    keys [T, W, Dh] (slot j = position p-W+1+j) and valid [T, W]."""
    offsets = torch.arange(window, device=kv.device) - (window - 1)  # [W]
    key_positions = positions[:, None] + offsets[None, :]  # [T, W]
    return kv[(key_positions - first).clamp_min(0)], key_positions >= 0


__all__ = ["V4Attention", "attend_with_sinks", "sliding_window_keys"]
