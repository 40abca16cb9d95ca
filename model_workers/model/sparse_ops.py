"""The DSA math shared by every torch backend: indexer scores, causal top-k, sparse absorbed-MLA attention.

All functions work on one request's keys at a time and process queries in chunks sized so that no
intermediate exceeds `budget_bytes`; nothing here ever materialises an L×L tensor for a long prompt.

Keys arrive as the cache stores them (bf16 / fp32 rows, or FP8 bytes) with a `decode` that turns stored rows
into values: the indexer decodes KEY_TILE keys at a time, attention only the top-k rows it gathered, so no
decoded copy of a request's keys is ever made.
"""

from __future__ import annotations

from typing import Callable

import torch

from model_workers.model.batch_invariant import padded_rows
from model_workers.model.topk_select import row_topk

Decode = Callable[[torch.Tensor, torch.dtype], torch.Tensor]  # stored rows [..., W], dtype -> values [..., D]


def as_dtype(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The decode of plain rows: a cast."""
    return stored.to(dtype)


def take_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [S, W] rows at ids [...] (all valid) -> [..., W]; `index_select`, 4-7x faster on CPU than
    `table[ids]` for the gathers here (top-k keys, a request's key slots)."""
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, table.shape[-1])

DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024
ATTENTION_BUDGET_BYTES = 4 * 1024 * 1024  # gathered keys per attention chunk: cache-sized (1.5x faster on CPU)


def rows_per_chunk(bytes_per_row: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    return max(1, budget_bytes // max(1, bytes_per_row))


QUERY_TILE = 64  # indexer query rows per tile
KEY_TILE = 1024  # indexer keys per tile: a [64, H, 1024] fp32 tile stays in cache (5-10x faster on CPU)
KEY_BLOCK = 64  # deterministic inference: tiles are whole blocks (a score's bits equal at 64..1024 keys, measured)


def indexer_scores(
    index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor, decode: Decode = as_dtype,
    fixed_tiles: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) in float32, computed (and decoded) KEY_TILE keys at a time.

    index_q [Tc, H, D]; index_weights [Tc, H] (all scales folded in); keys [K, W] stored rows -> [Tc, K].
    `fixed_tiles` (deterministic inference): the last tile is zero-padded to whole KEY_BLOCKs and the query rows
    to MIN_ROWS, so a score's bits depend neither on how many keys the request has nor on the queries beside it.
    `out`: a [Tc, K] float32 tensor to write the scores into (default: a new one).
    """
    num_rows, num_heads, dim = index_q.shape
    q_flat = index_q.float().reshape(num_rows * num_heads, dim)  # [Tc*H, D]
    if fixed_tiles:
        q_flat, _ = padded_rows(q_flat)  # at least MIN_ROWS rows: the product's bits do not depend on Tc
    weights = index_weights.float()  # [Tc, H]
    if out is None:
        out = torch.empty(num_rows, keys.shape[0], dtype=torch.float32, device=keys.device)
    workspace = q_flat.new_empty(q_flat.shape[0] * min(KEY_TILE, -(-keys.shape[0] // KEY_BLOCK) * KEY_BLOCK))
    for start in range(0, keys.shape[0], KEY_TILE):
        block = decode(keys[start : start + KEY_TILE], torch.float32)  # [Kb, D]
        count = block.shape[0]
        if fixed_tiles and count % KEY_BLOCK:
            block = torch.cat([block, block.new_zeros(KEY_BLOCK - count % KEY_BLOCK, block.shape[1])])
        dots = workspace[: q_flat.shape[0] * block.shape[0]].view(q_flat.shape[0], block.shape[0])  # [Tc*H, Kb]
        torch.mm(q_flat, block.t(), out=dots)  # into one reused tile: a new one each time costs page faults
        dots = dots[: num_rows * num_heads].clamp_min_(0).view(num_rows, num_heads, -1)  # [Tc, H, Kb]
        head_weighted_sum(dots[..., :count], weights, out[:, start : start + count])
    return out


def head_weighted_sum(dots: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, k] = Σ_h weights[t, h] · dots[t, h, k], heads added in order (elementwise: the same bits for a
    score whatever rows or keys are beside it; 1.6x faster than a [1, H] x [H, Kb] bmm per row on CPU).

    dots [Tc, H, Kb]; weights [Tc, H]; out [Tc, Kb] (a view, written in place)."""
    torch.mul(dots[:, 0], weights[:, :1], out=out)
    for head in range(1, dots.shape[1]):
        out.addcmul_(dots[:, head], weights[:, head : head + 1])


def causal_topk(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    topk: int,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    decode: Decode = as_dtype,
    deterministic: bool = False,
) -> torch.Tensor:
    """Top-k key positions per query among keys at positions 0..K-1 with position <= the query's.

    index_q [T, H, D]; index_weights [T, H]; keys [K, W] stored rows (row s = key at position s);
    query_positions [T]. Returns [T, min(topk, K)] int64 key positions, -1 where a query has fewer
    causal keys. Queries with at most `topk` causal keys take all of them in position order.
    Each query chunk scores only the keys up to its last query's position (causal work only).
    `deterministic`: scores on fixed key tiles, and ties broken towards the earlier key (`pick_causal`), so a
    query's picks do not depend on the queries and keys beside it.
    """
    num_keys = keys.shape[0]
    width = min(topk, num_keys)
    out = torch.full((index_q.shape[0], width), -1, dtype=torch.long, device=keys.device)
    chunk = min(QUERY_TILE, rows_per_chunk(num_keys * 4, budget_bytes))  # scores [chunk, K] fp32 in budget
    # one score buffer for every chunk: a fresh one each time costs its page faults again (11% of the time)
    buffer = torch.empty(min(chunk, index_q.shape[0]) * num_keys, dtype=torch.float32, device=keys.device)
    for start in range(0, index_q.shape[0], chunk):
        rows = slice(start, start + chunk)
        positions = query_positions[rows]
        visible = min(num_keys, int(positions.max()) + 1)  # keys past the chunk's last query never count
        scores = buffer[: positions.shape[0] * visible].view(positions.shape[0], visible)  # [Tc, K'] contiguous
        indexer_scores(index_q[rows], index_weights[rows], keys[:visible], decode, fixed_tiles=deterministic,
                       out=scores)
        out[rows, : min(width, visible)] = pick_causal(scores, positions, width, stable=deterministic)
    return out


def pick_causal(scores: torch.Tensor, positions: torch.Tensor, width: int, stable: bool = False) -> torch.Tensor:
    """scores [Tc, K'] over key positions 0..K'-1 -> [Tc, min(width, K')] picked positions, -1 = none.
    `stable`: equal scores (ReLU makes many exactly 0) are picked earliest key first, whatever K' is."""
    key_positions = torch.arange(scores.shape[1], device=scores.device)
    first_future = int(positions.min()) + 1  # keys before it are visible to every query of the chunk
    future = scores[:, first_future:]
    future.masked_fill_(key_positions[None, first_future:] > positions[:, None], float("-inf"))
    width = min(width, scores.shape[1])
    if stable:
        picked = earliest_topk(scores, width)  # [Tc, width]
    else:
        picked = row_topk(scores, width)[1]  # [Tc, width]
    if first_future < width:  # some query has fewer than `width` causal keys: -inf picks mean none
        picked = torch.where(torch.isinf(scores.gather(1, picked)), -1, picked)
    short = positions < width  # every causal key fits: take them all, in position order
    if short.any():
        all_keys = key_positions[:width].expand(int(short.sum()), width)
        picked[short] = torch.where(all_keys <= positions[short][:, None], all_keys, -1)
    return picked


def earliest_topk(scores: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` largest of each row [Tc, K'], a tie at the k-th value going to the earliest keys; returned in
    key order [Tc, width]. Trailing -inf keys (positions past the query) change nothing.

    Where the (k+1)-th largest value is below the k-th, the k largest are one set and only need ordering; the
    rows where a key outside them ties with the k-th value (`tied_earliest`) take the tie rule.
    """
    if scores.shape[1] == width:
        return torch.arange(width, device=scores.device).expand(scores.shape[0], width).clone()
    values, columns = row_topk(scores, width + 1)  # [Tc, width + 1] largest first
    picked = columns[:, :width].sort(dim=-1).values  # [Tc, width] key order
    tie_rows = torch.nonzero(values[:, width] == values[:, width - 1]).flatten()  # rows whose set is not unique
    if tie_rows.numel():
        picked[tie_rows] = tied_earliest(scores[tie_rows], values[tie_rows, width - 1 : width], width)
    return picked


def tied_earliest(scores: torch.Tensor, kth: torch.Tensor, width: int) -> torch.Tensor:
    """`earliest_topk` of rows [Tr, K'] whose k-th value kth [Tr, 1] is tied outside the top k: every key above
    it, then the earliest tied keys until there are `width`; in key order [Tr, width]."""
    above = scores > kth
    tied = scores == kth
    room = width - above.sum(-1, keepdim=True)  # [Tr, 1] tied keys to take
    chosen = above | (tied & (tied.cumsum(-1) <= room))  # exactly `width` per row
    return chosen.nonzero()[:, 1].view(scores.shape[0], width)


def batched_causal_topk(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    topk: int,
    decode: Decode = as_dtype,
) -> torch.Tensor:
    """`causal_topk` for B requests with a few query rows each (decode, verification), in one pass.

    index_q [B, n, H, D]; index_weights [B, n, H]; keys [B, K, W] stored rows (request b's key at position s
    in row s, rows past its length are ignored because they lie past every query's position), decoded
    KEY_TILE keys at a time; query_positions [B, n] (-1 marks a padding row). Returns [B, n, min(topk, K)]
    key positions, -1 = none.
    """
    num_requests, num_rows = query_positions.shape
    q, weights = index_q.float(), index_weights.float()
    scores = torch.empty(num_requests, num_rows, keys.shape[1], dtype=torch.float32, device=keys.device)
    for start in range(0, keys.shape[1], KEY_TILE):
        block = decode(keys[:, start : start + KEY_TILE], torch.float32)  # [B, Kb, D]
        dots = torch.einsum("bnhd,bkd->bnhk", q, block).clamp_min_(0)  # [B, n, H, Kb]
        scores[..., start : start + block.shape[1]] = torch.einsum("bnhk,bnh->bnk", dots, weights)  # [B, n, Kb]
    flat_positions = query_positions.reshape(-1)  # [B*n]
    picked = pick_causal(scores.view(num_requests * num_rows, -1), flat_positions, topk)
    return picked.view(num_requests, num_rows, -1)


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
