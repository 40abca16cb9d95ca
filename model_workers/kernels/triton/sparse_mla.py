"""Sparse absorbed-MLA attention over each query's selected key rows, as Triton kernels (the torch reference:
kernels/torch/sparse_mla.py).

One program attends one query row and a tile of BLOCK_H heads over the rows its key ids name in the paged store:
it gathers BLOCK_K rows at a time, decodes them where they are (plain rows, or FP8 rows: e4m3 values times their
block's float32 scale, bf16 k_pe), scores both parts with one pass (q_latent·c_kv + q_pe·k_pe), and keeps an
online softmax and the weighted sum of c_kv. A model with at least 64 heads runs 64-head tiles (one wgmma M on
Hopper). When the query rows times head tiles are few (decode), the key ids are split into NUM_SPLITS ranges run
by separate programs, and a combine pass merges their partial sums by their softmax maxima and sums.

Nothing here reads a tensor on the host: the launch depends only on shapes, so a decode step can be captured in
a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model_workers.kernels.triton.launch import FP8_BLOCK, RowLayout, pow2

NUM_STAGES = 2
SPLIT_BELOW_PROGRAMS = 64  # fewer (query row, head tile) programs than this: split the keys across programs
MAX_SPLITS = 16


@triton.jit
def _load_columns(keys_ptr, rows, valid, col0, C: tl.constexpr, scales_offset, BLOCK_K: tl.constexpr,
                  WIDTH: tl.constexpr, FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, dtype: tl.constexpr):
    """Columns col0.. col0+WIDTH-1 (a whole number of FP8 scale blocks, or one part of one) of the latent c_kv of
    the selected rows (row starts `rows` [BLOCK_K]) in `dtype` [BLOCK_K, WIDTH]; 0 where masked. FP8 bytes are read
    as 32-bit words (a quarter of the address registers of byte loads; rows are 4-byte aligned: kv_format's FP8
    parts and bf16 tails are), and values times their power-of-two scale are exact in bf16."""
    cols = col0 + tl.arange(0, WIDTH)
    mask = valid[:, None] & (cols < C)[None, :]
    if FP8:
        words_per_row: tl.constexpr = WIDTH // 4
        w_offs = col0 // 4 + tl.arange(0, words_per_row)
        word_rows = rows.to(tl.pointer_type(tl.int32))
        w_mask = valid[:, None] & (w_offs * 4 < C)[None, :]
        words = tl.load(word_rows[:, None] + w_offs[None, :], mask=w_mask, other=0)  # [BLOCK_K, WIDTH / 4] int32
        shifts = tl.arange(0, 4) * 8
        raw = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xFF, (BLOCK_K, WIDTH)).to(tl.uint8)
        blocks: tl.constexpr = WIDTH // SCALE_BLOCK if WIDTH >= SCALE_BLOCK else 1
        per_block: tl.constexpr = WIDTH // blocks
        block_ids = tl.arange(0, blocks) + col0 // SCALE_BLOCK  # the scale blocks the columns fall in
        scale_rows = (rows + scales_offset).to(tl.pointer_type(tl.float32))
        scales = tl.load(scale_rows[:, None] + block_ids[None, :],
                         mask=valid[:, None] & (block_ids * SCALE_BLOCK < C)[None, :], other=0.0)  # [BLOCK_K, blocks]
        values = tl.reshape(raw.to(tl.float8e4nv, bitcast=True).to(dtype), (BLOCK_K, blocks, per_block))
        return tl.reshape(values * scales.to(dtype)[:, :, None], (BLOCK_K, WIDTH))  # exact: powers of two
    return tl.load(rows[:, None] + cols[None, :], mask=mask, other=0.0).to(dtype)


@triton.jit
def _load_rope(keys_ptr, rows, valid, r_offs, R: tl.constexpr, C: tl.constexpr, tail_offset, FP8: tl.constexpr):
    """k_pe of the selected rows [BLOCK_K, R_PAD] as float32: bf16 after an FP8 row's scales, else after c_kv."""
    mask = valid[:, None] & (r_offs < R)[None, :]
    if FP8:
        tail_rows = (rows + tail_offset).to(tl.pointer_type(tl.bfloat16))
        return tl.load(tail_rows[:, None] + r_offs[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.load(rows[:, None] + C + r_offs[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def sparse_mla_kernel(
    q_latent_ptr, q_pe_ptr, keys_ptr, ids_ptr, out_ptr, part_ptr, stats_ptr,
    num_heads, width, keys_per_split, row_width, scales_offset, tail_offset, scale,
    C: tl.constexpr, R: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """Program (t, head tile x latent tile, split): query row t, heads [BLOCK_H tile), output latent columns
    [BLOCK_C tile), key ids [split*keys_per_split, +keys_per_split). q_latent [T, H, C], q_pe [T, H, R], ids
    [T, width] (-1 = none), out [T, H, C]. Scores take every latent column, CHUNK at a time; the weighted sum only
    the tile's. With SPLIT the unnormalized sums go to part [T, H, S, C] and (max, sum) to stats [T, H, S, 2]."""
    t, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_tiles: tl.constexpr = C_PAD // BLOCK_C
    heads = (tile // c_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    out_cols = (tile % c_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_offs = tl.arange(0, R_PAD)
    q_rows = (t * num_heads + heads).to(tl.int64)
    q_pe = tl.load(q_pe_ptr + q_rows[:, None] * R + r_offs[None, :], mask=h_mask[:, None] & (r_offs < R)[None, :],
                   other=0.0)  # [BLOCK_H, R_PAD]
    dtype = q_pe.dtype
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    start = split * keys_per_split
    for k0 in range(0, keys_per_split, BLOCK_K):
        offs = start + k0 + tl.arange(0, BLOCK_K)
        in_split = (offs < width) & (k0 + tl.arange(0, BLOCK_K) < keys_per_split)
        ids = tl.load(ids_ptr + t.to(tl.int64) * width + offs, mask=in_split, other=-1)  # [BLOCK_K]
        valid = ids >= 0
        rows = keys_ptr + tl.where(valid, ids, 0).to(tl.int64) * row_width  # [BLOCK_K] row starts
        k_pe = _load_rope(keys_ptr, rows, valid, r_offs, R, C, tail_offset, FP8)
        scores = tl.dot(q_pe, tl.trans(k_pe.to(dtype)))  # [BLOCK_H, BLOCK_K]
        for c in tl.static_range(C_PAD // CHUNK):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            q_part = tl.load(q_latent_ptr + q_rows[:, None] * C + cols[None, :],
                             mask=h_mask[:, None] & (cols < C)[None, :], other=0.0)  # [BLOCK_H, CHUNK]
            k_part = _load_columns(keys_ptr, rows, valid, c * CHUNK, C, scales_offset, BLOCK_K, CHUNK, FP8,
                                   SCALE_BLOCK, dtype)
            scores += tl.dot(q_part, tl.trans(k_part))
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)  # 0 while nothing was seen (m = -inf)
        p = tl.exp(scores - m_safe[:, None])  # [BLOCK_H, BLOCK_K], 0 at masked keys
        l = l * alpha + tl.sum(p, axis=1)
        values = _load_columns(keys_ptr, rows, valid, (tile % c_tiles) * BLOCK_C, C, scales_offset, BLOCK_K, BLOCK_C,
                               FP8, SCALE_BLOCK, dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), values)
        m = m_new
    o_mask = h_mask[:, None] & (out_cols < C)[None, :]
    if SPLIT:
        slot = q_rows * tl.num_programs(2) + split  # [BLOCK_H]
        tl.store(part_ptr + slot[:, None] * C + out_cols[None, :], acc, mask=o_mask)
        first_tile = (tile % c_tiles) == 0  # one latent tile writes the row's softmax statistics
        tl.store(stats_ptr + slot * 2, m, mask=h_mask & first_tile)
        tl.store(stats_ptr + slot * 2 + 1, l, mask=h_mask & first_tile)
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * C + out_cols[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def combine_kernel(part_ptr, stats_ptr, out_ptr, num_splits, C: tl.constexpr, C_PAD: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):
    """Program (row = t * H + h): out[row] = Σ_s e^(m_s - M) part_s / Σ_s e^(m_s - M) l_s over the key splits."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    s_mask = splits < num_splits
    c_offs = tl.arange(0, C_PAD)
    m = tl.load(stats_ptr + (row * num_splits + splits) * 2, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
    l = tl.load(stats_ptr + (row * num_splits + splits) * 2 + 1, mask=s_mask, other=0.0)
    top = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)))  # [SPLITS_PAD]
    parts = tl.load(part_ptr + (row * num_splits + splits)[:, None] * C + c_offs[None, :],
                    mask=s_mask[:, None] & (c_offs < C)[None, :], other=0.0)  # [SPLITS_PAD, C_PAD]
    total = tl.sum(weight * l, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * C + c_offs, out.to(out_ptr.dtype.element_ty), mask=c_offs < C)


@dataclass(frozen=True)
class Tiles:
    block_h: int  # heads per program: 64 (a Hopper wgmma's M) when the model has them
    block_c: int  # output latent columns per program
    block_k: int  # selected rows gathered per loop step
    chunk: int  # latent columns scored per product (one FP8 scale block at most)
    num_warps: int


def tiles_for(num_heads: int, latent: int, fp8: bool) -> Tiles:
    """The program tiles for `num_heads` heads of latent width `latent`. A 64-head tile holds its weighted sum for
    all 512 latent columns of V3.2 on plain bf16 rows (16 rows a step); on FP8 rows, whose decode takes registers
    too, for 256 columns (32 rows a step), the two programs of a row each scoring every column (1.5x the useful
    score products). Compiled for sm_90a with Triton's ptxas, these fit with no spill (tools/sm90_report.py); the
    FP8 tile at 512 columns spilled."""
    c_pad = pow2(latent)
    block_h = 64 if num_heads >= 64 else pow2(num_heads)
    block_c = min(c_pad, 256 if fp8 else 512)
    return Tiles(block_h, block_c, 32 if fp8 else 16, min(c_pad, FP8_BLOCK), 8 if block_h >= 64 else 4)


def split_count(rows: int, tiles_per_row: int, width: int, block_k: int) -> int:
    """Key splits for the decode path: enough programs to fill a GPU when query rows x tiles are few."""
    programs = rows * tiles_per_row
    if programs >= SPLIT_BELOW_PROGRAMS:
        return 1
    blocks = triton.cdiv(width, block_k)
    return max(1, min(MAX_SPLITS, triton.cdiv(SPLIT_BELOW_PROGRAMS, programs), blocks))


def sparse_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, key_rows: torch.Tensor, key_ids: torch.Tensor,
               scale: float, layout: RowLayout, splits: int | None = None, tiles: Tiles | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """q_latent [T, H, C], q_pe [T, H, R], key_rows [S, W] stored rows, key_ids [T, k] (-1 = none) -> [T, H, C].
    `splits`: key splits (None: 1, the prefill path; `split_count` picks it for decode); `out`: where to write."""
    rows, heads, latent = q_latent.shape
    rope = q_pe.shape[-1]
    q_latent, q_pe, key_ids = q_latent.contiguous(), q_pe.contiguous(), key_ids.contiguous()
    out = torch.empty_like(q_latent) if out is None else out
    width = key_ids.shape[1]
    if rows == 0 or width == 0:
        return out.zero_()
    tiles = tiles or tiles_for(heads, latent, layout.fp8)
    programs = triton.cdiv(heads, tiles.block_h) * (pow2(latent) // tiles.block_c)
    splits = splits or 1
    per_split = triton.cdiv(triton.cdiv(width, splits), tiles.block_k) * tiles.block_k
    splits = triton.cdiv(width, per_split)
    part = stats = out
    if splits > 1:
        part = torch.empty(rows, heads, splits, latent, dtype=torch.float32, device=q_latent.device)
        stats = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q_latent.device)
    sparse_mla_kernel[(rows, programs, splits)](
        q_latent, q_pe, key_rows, key_ids, out, part, stats, heads, width, per_split, layout.row_width,
        layout.scales_offset, layout.tail_offset, scale, C=latent, R=rope, C_PAD=pow2(latent), R_PAD=pow2(rope),
        BLOCK_H=tiles.block_h, BLOCK_K=tiles.block_k, BLOCK_C=tiles.block_c, CHUNK=tiles.chunk, FP8=layout.fp8,
        SPLIT=splits > 1, SCALE_BLOCK=FP8_BLOCK, num_warps=tiles.num_warps, num_stages=NUM_STAGES)
    if splits > 1:
        combine_kernel[(rows * heads,)](part, stats, out, splits, C=latent, C_PAD=pow2(latent),
                                        SPLITS_PAD=pow2(splits, 2))
    return out


def sparse_mla_prefill(q_latent, q_pe, key_rows, key_ids, scale: float, layout: RowLayout) -> torch.Tensor:
    return sparse_mla(q_latent, q_pe, key_rows, key_ids, scale, layout)


def sparse_mla_decode(q_latent, q_pe, key_rows, key_ids, scale: float, layout: RowLayout) -> torch.Tensor:
    heads, latent = q_latent.shape[1], q_latent.shape[2]
    tiles = tiles_for(heads, latent, layout.fp8)
    per_row = triton.cdiv(heads, tiles.block_h) * (pow2(latent) // tiles.block_c)
    splits = split_count(q_latent.shape[0], per_row, key_ids.shape[1], tiles.block_k)
    return sparse_mla(q_latent, q_pe, key_rows, key_ids, scale, layout, splits)


def _config(name: str, heads: int, latent: int, rope: int, fp8: bool, split: bool) -> dict:
    tiles = tiles_for(heads, latent, fp8)
    q = "*bf16"
    signature = {"q_latent_ptr": q, "q_pe_ptr": q, "keys_ptr": "*u8" if fp8 else q, "ids_ptr": "*i64", "out_ptr": q,
                 "part_ptr": "*fp32", "stats_ptr": "*fp32", "num_heads": "i32", "width": "i32",
                 "keys_per_split": "i32", "row_width": "i32", "scales_offset": "i32", "tail_offset": "i32",
                 "scale": "fp32"}
    constexprs = dict(C=latent, R=rope, C_PAD=pow2(latent), R_PAD=pow2(rope), BLOCK_H=tiles.block_h,
                      BLOCK_K=tiles.block_k, BLOCK_C=tiles.block_c, CHUNK=tiles.chunk, FP8=fp8, SPLIT=split,
                      SCALE_BLOCK=FP8_BLOCK)
    return {"name": name, "kernel": sparse_mla_kernel, "signature": {**signature, **dict.fromkeys(constexprs,
            "constexpr")}, "constexprs": constexprs, "num_warps": tiles.num_warps, "num_stages": NUM_STAGES,
            "wgmma": tiles.block_h >= 64,
            "divisible_by_16": ("num_heads", "width", "keys_per_split", "row_width", "scales_offset", "tail_offset")
            if heads % 16 == 0 else ()}


# What the launchers run at DeepSeek-V3.2 / GLM-5 shapes (128 / 64 heads: 64-head tiles, latent 512, rope 64) and
# at the default model's (16 heads, latent 64, rope 32): tools/sm90_report.py compiles each for sm_90a.
COMPILE_CONFIGS = [
    _config(f"sparse_mla {kind} {fmt} {shape}", heads, latent, rope, fmt == "fp8", kind == "decode-split")
    for shape, heads, latent, rope in (("v32", 128, 512, 64), ("default", 16, 64, 32))
    for kind in ("prefill", "decode-split") for fmt in ("bf16", "fp8")
] + [{"name": "sparse_mla combine v32", "kernel": combine_kernel,
      "signature": {"part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16", "num_splits": "i32",
                    "C": "constexpr", "C_PAD": "constexpr", "SPLITS_PAD": "constexpr"},
      "constexprs": {"C": 512, "C_PAD": 512, "SPLITS_PAD": MAX_SPLITS}, "num_warps": 4, "num_stages": 1,
      "wgmma": False}]
