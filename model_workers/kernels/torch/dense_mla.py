"""Dense causal absorbed-MLA attention over every earlier key of one request (no indexer).

The baseline the DSA sparse path is measured against (`dsa-serve bench attention`). It is written in the
same form as `sparse_mla.sparse_mla_attention` (two score terms, float32 softmax, probabilities cast back
to the latent dtype) so the two differ only in which keys they read. Queries run in chunks sized so that
no intermediate exceeds `budget_bytes`, and each chunk reads only the keys up to its last query's
position: no L×L tensor for a long prompt, and no work on keys that the causal mask would drop.
"""

from __future__ import annotations

import torch

from model_workers.kernels.torch.gather import ATTENTION_BUDGET_BYTES, rows_per_chunk


def dense_causal_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    key_latent: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    budget_bytes: int = ATTENTION_BUDGET_BYTES,
) -> torch.Tensor:
    """Absorbed MLA over all causal keys of one request.

    q_latent [T, H, C]; q_pe [T, H, R]; key_latent [K, C + R] (row s = key at position s);
    query_positions [T] ascending, each < K. Query t attends to key rows 0..positions[t].
    Returns [T, H, C] in q_latent's dtype.
    """
    num_rows, num_heads, latent_dim = q_latent.shape
    num_keys = key_latent.shape[0]
    out = torch.empty_like(q_latent)
    # per query row: float32 scores and probabilities, plus the cast probabilities, over up to K keys
    chunk = rows_per_chunk(num_heads * num_keys * (4 + 4 + key_latent.element_size()), budget_bytes)
    for start in range(0, num_rows, chunk):
        rows = slice(start, start + chunk)
        positions = query_positions[rows]  # [Tc]
        visible = min(num_keys, int(positions.max()) + 1)  # keys past the chunk's last query never count
        c_kv, k_pe = key_latent[:visible, :latent_dim], key_latent[:visible, latent_dim:]  # [K', C], [K', R]
        scores = torch.einsum("thc,kc->thk", q_latent[rows], c_kv) + torch.einsum("thr,kr->thk", q_pe[rows], k_pe)
        scores = scores.float() * scale  # [Tc, H, K']
        future = torch.arange(visible, device=scores.device)[None, :] > positions[:, None]  # [Tc, K']
        scores.masked_fill_(future[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(c_kv.dtype)  # [Tc, H, K']
        out[rows] = torch.einsum("thk,kc->thc", probs, c_kv)
    return out
