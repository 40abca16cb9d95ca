"""Top-k selection (the torch reference): each query's `topk` keys by indexer score, causal by global position.

Queries are scored in chunks sized so that no intermediate exceeds `budget_bytes`, each chunk only over the keys up
to its last query's position: nothing here ever materialises an L×L tensor for a long prompt.
"""

from __future__ import annotations

import torch

from model_workers.kernels.torch.gather import DEFAULT_BUDGET_BYTES, Decode, as_dtype, rows_per_chunk
from model_workers.kernels.torch.indexer import KEY_TILE, QUERY_TILE, indexer_scores
from model_workers.kernels.torch.topk_select import row_topk

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
