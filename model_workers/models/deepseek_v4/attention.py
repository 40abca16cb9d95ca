"""DeepSeek-V4 attention, the part every layer shares (docs/models.md, 'Attention and compressors'): the q path
(low rank, weighted then per-head unweighted RMS norm, partial interleaved RoPE), the one shared K = V head,
attention over each query's own key rows with a per-head sink logit, the output's RoPE slice de-rotated at
the query position, and the grouped low-rank output projection.

A query sees its sliding window of raw entries and, on CSA / HCA layers, compressed entries: all visible
ones (HCA) or the lightning indexer's top-k (CSA). Which rows exist is the backend's business
(`V4AttentionBackend`); `attend_sources` runs one softmax over them, block by block of a request's queries:
the window as one contiguous run of rows per block, HCA entries shared by the block, CSA picks per query.
Parameter names follow the checkpoint (`self_attn.q_a_proj`, `self_attn.sinks`, `self_attn.compressor...`).
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.models.common.layers import RMSNorm
from model_workers.models.common.linear import Linear
from model_workers.models.common.rope import RotaryTable, rotate_pairs
from model_workers.models.deepseek_v4.blocks import unweighted_rms
from model_workers.models.deepseek_v4.compress import CSACompressor, HCACompressor, visible_entries
from model_workers.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config

# Queries of one request attended together. A block's window rows are one contiguous run (b·stride + W - 1
# rows for b queries), so small blocks waste less; measured on CPU for W = 128 (the small V4, 4096-token
# prefill at C = 1): 6.2 s at 256, 4.4 s at 64, 3.4 s at 32, 4.4 s at 16.
QUERY_BLOCK = 32


def attend_sources(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [b, H, Dh] over one softmax of several key sources (keys are their own values) and a per-head sink logit
    (sinks [H], no value) -> [b, H, Dh]. A source is (keys [m, Dh] shared by every query, valid [b, m]) or
    (keys [b, k, Dh] per query, valid [b, k])."""
    q32, parts = q.float(), []
    for keys, valid in sources:
        pattern = "bhd,md->bhm" if keys.dim() == 2 else "bhd,bkd->bhk"
        logits = torch.einsum(pattern, q32, keys.float()) * scale  # [b, H, m]
        parts.append(logits.masked_fill(~valid[:, None, :], float("-inf")))
    parts.append(sinks.float()[None, :, None].expand(q.shape[0], -1, 1))  # [b, H, 1]
    combined = torch.cat(parts, dim=-1)
    probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)
    out, offset = torch.zeros_like(q32), 0
    for (keys, _), part in zip(sources, parts):
        width = part.shape[-1]
        pattern = "bhm,md->bhd" if keys.dim() == 2 else "bhk,bkd->bhd"
        out = out + torch.einsum(pattern, probs[..., offset : offset + width], keys.float())
        offset += width
    return out.to(q.dtype)


def window_source(rows: torch.Tensor, first: int, positions: torch.Tensor,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K = V rows [n, Dh] of positions first.. and some of its queries (positions [b]) -> the key
    rows those queries' windows (p-W, p] span [m, Dh] and valid [b, m]."""
    low, high = max(int(positions.min()) - window + 1, first, 0), int(positions.max()) + 1
    key_positions = torch.arange(low, high, device=rows.device)  # [m]
    valid = (key_positions[None, :] <= positions[:, None]) & (key_positions[None, :] > positions[:, None] - window)
    return rows[low - first : high - first], valid


class V4Attention(nn.Module):
    timing_phase = "attention_total"  # model_workers/phase_clock.py: compressors, indexer, KV store excluded

    def __init__(self, config: V4Config, layer_type: str = SLIDING):
        super().__init__()
        heads, head_dim, groups = config.num_attention_heads, config.head_dim, config.o_groups
        self.num_heads, self.head_dim, self.rope_dim = heads, head_dim, config.qk_rope_head_dim
        self.o_groups, self.eps, self.scale = groups, config.rms_norm_eps, head_dim**-0.5
        self.window = config.sliding_window
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, heads * head_dim, bias=False)
        self.kv_proj = Linear(config.hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.o_a_proj = Linear(heads * head_dim // groups, groups * config.o_lora_rank, bias=False)
        self.o_b_proj = Linear(groups * config.o_lora_rank, config.hidden_size, bias=False)
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
        windows = backend.window_rows(layer_id, self.key_values(x, cos, sin))  # per request: (rows, first)
        compressed = self.compressed_rows(x, q_residual, positions, table, backend, layer_id)
        out = torch.zeros_like(q)
        for s, rows in enumerate(backend.request_rows):
            for block in rows.split(QUERY_BLOCK) if rows.numel() else ():  # a CP rank may hold none of s
                sources = [window_source(*windows[s], positions[block], self.window)]
                if compressed is not None:
                    sources += self.compressed_source(compressed, s, block, positions)
                out[block] = attend_sources(q[block], [(k.to(q.dtype), v) for k, v in sources], self.sinks,
                                            self.scale)
        return self.output(out, cos, sin)

    def compressed_rows(self, x, q_residual, positions, table: RotaryTable, backend, layer_id: int):
        """CSA / HCA layers: per request the entries (CSA: also its indexer keys, and the indexer's queries of
        every row), or None on sliding-only layers."""
        compressor = self.compressor
        if compressor is None:
            return None
        entries = backend.compressed_entries(layer_id, compressor, table, *compressor.project(x))  # [n_s, Dh]
        indexer = getattr(compressor, "indexer", None)
        if indexer is None:
            return entries, None, None
        index_keys = backend.compressed_entries(layer_id, indexer, table, *indexer.project(x))  # [n_s, d_I]
        return entries, index_keys, indexer.queries(x, q_residual, *table.for_positions(positions))

    def compressed_source(self, compressed, s: int, block: torch.Tensor, positions: torch.Tensor) -> list:
        """The compressed keys of request s that the queries `block` attend: every visible entry (HCA, shared
        by the block) or each query's indexer top-k (CSA)."""
        entries, index_keys, index_queries = compressed
        if entries[s].shape[0] == 0:
            return []
        if index_keys is None:
            return [(entries[s], visible_entries(positions[block], entries[s].shape[0], self.compressor.rate))]
        index_q, index_w = index_queries
        picked = self.compressor.indexer.select(index_q[block], index_w[block], index_keys[s], positions[block])
        return [(entries[s][picked.clamp_min(0)], picked >= 0)]  # [b, k, Dh], [b, k]

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

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE on the trailing `qk_rope_head_dim` channels ([nope | rope]); cos/sin [T, r/2]."""
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :]
        return torch.cat([nope, rotate_pairs(rope, cos, sin, inverse)], dim=-1)


__all__ = ["V4Attention", "attend_sources", "window_source"]
