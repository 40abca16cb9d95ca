"""The lightning indexer's logits as a Triton kernel (the torch reference: kernels/torch/indexer.py and topk.py):
score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) for keys at positions s <= the query's position, -inf after it.

One program scores a block of query rows that read the same keys (rows of one request) against BLOCK_K keys,
read from the paged store through the request's slots and decoded in place (plain rows, or FP8 rows: e4m3 values
times their float32 scale). The query rows' heads are one product's M (BLOCK_R x H rows: 64 for V3.2's indexer at
decode, a wgmma tile on Hopper). A key block past every query of the program is not computed (causal block
skipping): it is written -inf at once. The launch reads nothing on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_workers.kernels.triton.launch import FP8_BLOCK, RowLayout, pow2


@triton.jit
def indexer_logits_kernel(
    q_ptr, w_ptr, store_ptr, slots_ptr, positions_ptr, out_ptr,
    num_rows, rows_per_group, num_keys, num_heads, row_width, scales_offset,
    D: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, SHARED_KEYS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """Program (row block, key block). q [N, H, D], w [N, H] float32, slots [G, K] (one row of key slots per group
    of `rows_per_group` query rows; SHARED_KEYS: one row for all), positions [N] (-1: a padding row), out [N, K]."""
    block, kb = tl.program_id(0), tl.program_id(1)
    if SHARED_KEYS:
        first, last, group = block * BLOCK_R, tl.minimum(block * BLOCK_R + BLOCK_R, num_rows), block * 0
    else:  # one group (a request's rows) per program
        first, group = block * rows_per_group, block
        last = first + rows_per_group
    rows = first + tl.arange(0, BLOCK_R)
    r_mask = rows < last
    keys = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = keys < num_keys
    positions = tl.load(positions_ptr + rows, mask=r_mask, other=-1)  # [BLOCK_R]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * num_keys + keys[None, :]
    o_mask = r_mask[:, None] & k_mask[None, :]
    if kb * BLOCK_K > tl.max(positions, axis=0):  # every key of the block lies after every query of the block
        tl.store(out_ptrs, tl.full([BLOCK_R, BLOCK_K], float("-inf"), tl.float32), mask=o_mask)
    else:
        d_offs = tl.arange(0, D_PAD)
        d_mask = d_offs < D
        slots = tl.load(slots_ptr + group.to(tl.int64) * num_keys + keys, mask=k_mask, other=0)  # [BLOCK_K]
        key_rows = store_ptr + slots.to(tl.int64) * row_width
        kd_mask = k_mask[:, None] & d_mask[None, :]
        if FP8:
            raw = tl.load(key_rows[:, None] + d_offs[None, :], mask=kd_mask, other=0)
            scale_rows = (key_rows + scales_offset).to(tl.pointer_type(tl.float32))
            scales = tl.load(scale_rows[:, None] + (d_offs // SCALE_BLOCK)[None, :], mask=kd_mask, other=0.0)
            k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales  # [BLOCK_K, D_PAD]
        else:
            k = tl.load(key_rows[:, None] + d_offs[None, :], mask=kd_mask, other=0.0).to(tl.float32)
        heads = tl.arange(0, H_PAD)
        qh_rows = (rows[:, None] * num_heads + heads[None, :]).to(tl.int64)  # [BLOCK_R, H_PAD]
        qh_mask = r_mask[:, None] & (heads < num_heads)[None, :]
        q = tl.load(q_ptr + qh_rows[:, :, None] * D + d_offs[None, None, :],
                    mask=qh_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # [BLOCK_R, H_PAD, D_PAD]
        w = tl.load(w_ptr + qh_rows, mask=qh_mask, other=0.0)  # [BLOCK_R, H_PAD] float32
        q2 = tl.reshape(q, (BLOCK_R * H_PAD, D_PAD))
        dots = tl.maximum(tl.dot(q2, tl.trans(k.to(q2.dtype))), 0.0)  # [BLOCK_R * H_PAD, BLOCK_K] float32
        weighted = dots * tl.reshape(w, (BLOCK_R * H_PAD,))[:, None]
        scores = tl.sum(tl.reshape(weighted, (BLOCK_R, H_PAD, BLOCK_K)), axis=1)  # [BLOCK_R, BLOCK_K]
        scores = tl.where(keys[None, :] <= positions[:, None], scores, float("-inf"))
        tl.store(out_ptrs, scores, mask=o_mask)


def logits_rows(num_heads: int) -> int:
    """Query rows per program when many rows share keys (prefill): BLOCK_R x H_PAD product rows, about 64."""
    return max(1, 64 // pow2(num_heads, 1))


def indexer_logits(index_q: torch.Tensor, index_weights: torch.Tensor, store: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, layout: RowLayout, rows_per_group: int | None = None,
                   block_k: int = 64, out: torch.Tensor | None = None) -> torch.Tensor:
    """index_q [N, H, D], index_weights [N, H] (scales folded in), store [S, W] stored key rows, positions [N] (-1:
    padding row) -> logits [N, K] float32, -inf at keys after the row's position.

    slots [K] (one request's keys, every row reads them) or [G, K] with `rows_per_group` rows per group
    (G requests of a few rows each: decode, verification). `out`: where to write (every entry is written)."""
    num_rows, heads, dim = index_q.shape
    shared = slots.dim() == 1
    num_keys = slots.shape[-1]
    if out is None:
        out = torch.empty(num_rows, num_keys, dtype=torch.float32, device=index_q.device)
    if num_rows == 0 or num_keys == 0:
        return out
    if shared:
        block_r = logits_rows(heads)
        grid_rows, group = triton.cdiv(num_rows, block_r), num_rows
    else:
        block_r, group = pow2(max(rows_per_group, 16 // pow2(heads, 1)), 1), rows_per_group  # product M >= 16
        grid_rows = slots.shape[0]
    indexer_logits_kernel[(grid_rows, triton.cdiv(num_keys, block_k))](
        index_q.contiguous(), index_weights.float().contiguous(), store, slots.contiguous(), positions.contiguous(),
        out, num_rows, group, num_keys, heads, layout.row_width, layout.scales_offset, D=dim, D_PAD=pow2(dim),
        H_PAD=pow2(heads, 1), BLOCK_R=block_r, BLOCK_K=block_k, FP8=layout.fp8, SHARED_KEYS=shared,
        SCALE_BLOCK=FP8_BLOCK, num_warps=4)
    return out


def _config(name: str, heads: int, dim: int, fp8: bool, shared: bool, rows_per_group: int) -> dict:
    block_r = logits_rows(heads) if shared else pow2(max(rows_per_group, 16 // pow2(heads, 1)), 1)
    signature = {"q_ptr": "*bf16", "w_ptr": "*fp32", "store_ptr": "*u8" if fp8 else "*bf16", "slots_ptr": "*i64",
                 "positions_ptr": "*i64", "out_ptr": "*fp32", "num_rows": "i32", "rows_per_group": "i32",
                 "num_keys": "i32", "num_heads": "i32", "row_width": "i32", "scales_offset": "i32"}
    constexprs = dict(D=dim, D_PAD=pow2(dim), H_PAD=pow2(heads, 1), BLOCK_R=block_r, BLOCK_K=64, FP8=fp8,
                      SHARED_KEYS=shared, SCALE_BLOCK=FP8_BLOCK)
    return {"name": name, "kernel": indexer_logits_kernel,
            "signature": {**signature, **dict.fromkeys(constexprs, "constexpr")}, "constexprs": constexprs,
            "num_warps": 4, "num_stages": 3, "wgmma": block_r * pow2(heads, 1) >= 64,
            "divisible_by_16": ("num_keys", "num_heads", "scales_offset") if heads % 16 == 0 else ("num_keys",)}


# DeepSeek-V3.2's indexer (64 heads x 128; GLM-5's is the same shape): a prefill chunk (rows share keys), a decode
# step (one row a request) and a k = 3 verify (4 rows); the default model's (4 heads x 32): tools/sm90_report.py.
COMPILE_CONFIGS = [
    _config(f"indexer {kind} {fmt} {shape}", heads, dim, fmt == "fp8", kind == "prefill", rows)
    for shape, heads, dim in (("v32", 64, 128), ("default", 4, 32))
    for kind, rows in (("prefill", 1), ("decode", 1), ("verify", 4)) for fmt in ("bf16", "fp8")
]
