"""The DSA math shared by every torch backend: indexer scores, causal top-k, sparse absorbed-MLA attention.

All functions work on one request's keys at a time and process queries in chunks sized so that no
intermediate exceeds `budget_bytes`; nothing here ever materialises an L×L tensor for a long prompt.
"""

from __future__ import annotations

import torch

DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024


def rows_per_chunk(bytes_per_row: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    return max(1, budget_bytes // max(1, bytes_per_row))


def indexer_scores(index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) in float32.

    index_q [Tc, H, D]; index_weights [Tc, H] (all scales folded in); keys [K, D] -> [Tc, K].
    """
    dots = torch.matmul(index_q.float(), keys.float().t())  # [Tc, H, K]
    return torch.einsum("thk,th->tk", dots.clamp_min_(0), index_weights.float())


def causal_topk(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    topk: int,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Top-k key positions per query among keys at positions 0..K-1 with position <= the query's.

    index_q [T, H, D]; index_weights [T, H]; keys [K, D] (row s = key at position s);
    query_positions [T]. Returns [T, min(topk, K)] int64 key positions, -1 where a query has fewer
    causal keys. Queries with at most `topk` causal keys take all of them in position order.
    """
    num_keys = keys.shape[0]
    width = min(topk, num_keys)
    out = torch.full((index_q.shape[0], width), -1, dtype=torch.long, device=keys.device)
    chunk = rows_per_chunk(index_q.shape[1] * num_keys * 4, budget_bytes)
    key_positions = torch.arange(num_keys, device=keys.device)
    for start in range(0, index_q.shape[0], chunk):
        rows = slice(start, start + chunk)
        positions = query_positions[rows]
        scores = indexer_scores(index_q[rows], index_weights[rows], keys)  # [Tc, K]
        future = key_positions[None, :] > positions[:, None]  # [Tc, K]
        scores.masked_fill_(future, float("-inf"))
        picked = scores.topk(width, dim=-1).indices  # [Tc, width]
        picked = torch.where(torch.isinf(scores.gather(1, picked)), -1, picked)
        short = positions < width  # every causal key fits: take them all, in position order
        if short.any():
            all_keys = key_positions[:width].expand(int(short.sum()), width)
            picked[short] = torch.where(all_keys <= positions[short][:, None], all_keys, -1)
        out[rows] = picked
    return out


def sparse_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    key_latent: torch.Tensor,
    key_ids: torch.Tensor,
    scale: float,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Absorbed MLA over gathered keys.

    q_latent [T, H, C]; q_pe [T, H, R]; key_latent [S, C + R] (the store rows are indexed by key_ids);
    key_ids [T, k] into key_latent rows, -1 = masked. Returns [T, H, C] in q_latent's dtype.
    """
    num_rows, _, latent_dim = q_latent.shape
    out = torch.empty_like(q_latent)
    width = key_ids.shape[1]
    chunk = rows_per_chunk(width * (key_latent.shape[1] + q_latent.shape[1]) * 4, budget_bytes)
    for start in range(0, num_rows, chunk):
        rows = slice(start, start + chunk)
        ids = key_ids[rows]  # [Tc, k]
        gathered = key_latent[ids.clamp_min(0)]  # [Tc, k, C + R]
        c_kv, k_pe = gathered[..., :latent_dim], gathered[..., latent_dim:]
        scores = torch.einsum("thc,tkc->thk", q_latent[rows], c_kv) + torch.einsum("thr,tkr->thk", q_pe[rows], k_pe)
        scores = scores.float() * scale
        scores.masked_fill_((ids < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(c_kv.dtype)  # [Tc, H, k]
        out[rows] = torch.einsum("thk,tkc->thc", probs, c_kv)
    return out
