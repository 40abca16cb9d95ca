"""Sparse absorbed-MLA attention (the torch reference): each query attends to the key rows it selected.

Keys arrive as the cache stores them; only the gathered top-k rows are decoded, chunk by chunk of queries sized so
that the gathered keys of a chunk stay within `budget_bytes`.
"""

from __future__ import annotations

import torch

from model_workers.kernels.torch.gather import ATTENTION_BUDGET_BYTES, Decode, as_dtype, rows_per_chunk, take_rows

def sparse_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    key_latent: torch.Tensor,
    key_ids: torch.Tensor,
    scale: float,
    budget_bytes: int = ATTENTION_BUDGET_BYTES,
    decode: Decode = as_dtype,
) -> torch.Tensor:
    """Absorbed MLA over gathered keys.

    q_latent [T, H, C]; q_pe [T, H, R]; key_latent [S, W] stored rows (indexed by key_ids; `decode` turns the
    gathered ones into [.., C + R] values); key_ids [T, k] into key_latent rows, -1 = masked.
    Returns [T, H, C] in q_latent's dtype.
    """
    num_rows, _, latent_dim = q_latent.shape
    out = torch.empty_like(q_latent)
    width = key_ids.shape[1]
    chunk = rows_per_chunk(width * (key_latent.shape[1] + q_latent.shape[1]) * 4, budget_bytes)
    for start in range(0, num_rows, chunk):
        rows = slice(start, start + chunk)
        ids = key_ids[rows]  # [Tc, k]
        gathered = decode(take_rows(key_latent, ids.clamp_min(0)), q_latent.dtype)  # [Tc, k, C + R]: top-k rows
        q = torch.cat([q_latent[rows], q_pe[rows]], dim=-1)  # [Tc, H, C + R]: one product scores both parts
        scores = torch.bmm(q, gathered.transpose(1, 2)).float().mul_(scale)  # [Tc, H, k]
        missing = ids < 0  # [Tc, k] (a query with fewer than k causal keys)
        if bool(missing.any()):
            scores.masked_fill_(missing[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(gathered.dtype)  # [Tc, H, k]
        out[rows] = torch.bmm(probs, gathered[..., :latent_dim])  # values: the c_kv part of each key (autograd-safe)
    return out
