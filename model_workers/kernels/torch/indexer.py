"""Indexer logits (the torch reference): score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) over stored key rows.

Keys arrive as the cache stores them (bf16 / fp32 rows, or FP8 bytes) with a `decode` that turns stored rows into
values, KEY_TILE keys at a time, so no decoded copy of a request's keys is ever made.
"""

from __future__ import annotations

import torch

from model_workers.kernels.torch.batch_invariant import padded_rows
from model_workers.kernels.torch.gather import Decode, as_dtype

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
