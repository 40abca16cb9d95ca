"""The MoE expert loop as Triton kernels: a grouped GEMM over the routed rows, with no loop over experts and no
host sync (CUDA-graph safe).

The T·k routed slots are grouped by expert on the device (`route_blocks`: argsort, searchsorted and cumsum into
buffers of a size fixed by T, k, E_local and BLOCK_M alone): each expert's slots fill whole blocks of BLOCK_M
positions (padding = -1), and the slots of experts not held here (expert parallelism) and of id -1 form one more
group, E_local. `_gate_up_kernel` computes gate and up over each block of one expert's rows with SwiGLU fused
(the torch `swiglu`: clamp by `swiglu_limit`, silu(gate) · up) into h [positions, I]; `_down_kernel` multiplies
h by the expert's down_proj and the routing weight into the slot's row of [T·k, hidden], and writes 0 for the
group not held. `_ordered_sum_kernel` adds each row's k slots in expert-id order (the torch
`sum_in_expert_order`: its bits wherever each expert ran). Accumulation is float32, outputs in x's dtype.

Weights are the module's dense ones (bf16 / fp32) or DeepSeek's block-quantized FP8 (float8_e4m3fn [E, N, K] with
float32 scale_inv [E, ceil(N/128), ceil(K/128)]), dequantized tile by tile inside the kernels (`fp8_scales`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model_workers.kernels.torch.experts import expert_slots, expert_sum, sum_in_expert_order
from model_workers.kernels.triton.launch import pow2

QUANT_BLOCK = 128  # weights per FP8 scale, both ways (DeepSeek's weight_block_size)


@dataclass(frozen=True)
class Tiles:
    """One launch config of a GEMM kernel: BLOCK_M routed rows x BLOCK_N outputs, BLOCK_K inputs per step
    (BLOCK_K divides QUANT_BLOCK, so a step reads one FP8 scale per output row)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (kernel, BLOCK_M) -> tiles: BLOCK_M 16 while experts get few rows (decode), 64 for prefill (wgmma tiles)
TILES = {
    ("gate_up", 16): Tiles(16, 64, 128, 4, 4), ("gate_up", 64): Tiles(64, 64, 64, 4, 4),
    ("down", 16): Tiles(16, 64, 128, 4, 4), ("down", 64): Tiles(64, 128, 64, 8, 4),
}
SUM_BLOCK = 1024  # hidden values per program of the ordered sum
SUM_WARPS = 4


def block_m_for(num_slots: int, num_local: int) -> int:
    """64-row blocks once experts average 16 routed rows or more, else 16 (less padding)."""
    return 64 if num_slots >= 16 * num_local else 16


@triton.jit
def _aligned(base, offsets, ALIGNED: tl.constexpr):
    """base + offsets [R, C], marked as rows starting on 16 bytes when they do (the launcher checks): 16-byte
    vector loads, which cp.async pipelining needs. (A hint on a function argument is lost when inlined.)"""
    ptrs = base + offsets
    if ALIGNED:
        ptrs = tl.multiple_of(ptrs, [16, 16])
    return ptrs


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ws_ptr, h_ptr, slot_ptr, block_expert_ptr, num_local, top_k, limit,
                    HIDDEN: tl.constexpr, INNER: tl.constexpr, HAS_LIMIT: tl.constexpr, FP8_W: tl.constexpr,
                    ALIGNED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """h[pos, n] = swiglu(x[token] · gate[e, n], x[token] · up[e, n]) for a block of one expert's positions."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= num_local:  # the group not held here, or past the last group
        return
    pos = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    slots = tl.load(slot_ptr + pos)  # [BM] flat slot t·k + j, -1 = padding
    valid = slots >= 0
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] inner units
    col_ok = cols < INNER
    ks = tl.arange(0, BLOCK_K)
    expert = expert.to(tl.int64)
    gate_rows = w_ptr + expert * (2 * INNER * HIDDEN) + cols[:, None] * HIDDEN  # [BN, 1]
    up_rows = gate_rows + INNER * HIDDEN
    scale_cols: tl.constexpr = (HIDDEN + 127) // 128
    gate_scales = ws_ptr + (expert * ((2 * INNER + 127) // 128) + cols // 128) * scale_cols  # [BN]
    up_scales = ws_ptr + (expert * ((2 * INNER + 127) // 128) + (cols + INNER) // 128) * scale_cols
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < HIDDEN
        a_ptrs = _aligned(x_ptr, tokens[:, None] * HIDDEN + kk[None, :], ALIGNED)  # [BM, BK]
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        gate = tl.load(_aligned(gate_rows, kk[None, :], ALIGNED), mask=w_mask, other=0.0)  # [BN, BK]
        up = tl.load(_aligned(up_rows, kk[None, :], ALIGNED), mask=w_mask, other=0.0)
        if FP8_W:
            gate_scale = tl.load(gate_scales + k0 // 128, mask=col_ok, other=0.0)  # [BN]
            up_scale = tl.load(up_scales + k0 // 128, mask=col_ok, other=0.0)
            gate = gate.to(tl.float32) * gate_scale[:, None]
            up = up.to(tl.float32) * up_scale[:, None]
        acc_gate = tl.dot(a, tl.trans(gate.to(a.dtype)), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.trans(up.to(a.dtype)), acc_up, input_precision=PRECISION)
    if HAS_LIMIT:
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BM, BN] silu(gate) · up
    out = _aligned(h_ptr, pos.to(tl.int64)[:, None] * INNER + cols[None, :], ALIGNED)  # [BM, BN]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, ws_ptr, route_w_ptr, out_ptr, slot_ptr, block_expert_ptr, num_local,
                 HIDDEN: tl.constexpr, INNER: tl.constexpr, FP8_W: tl.constexpr, ALIGNED: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[slot, n] = weight[slot] · (h[pos] · down[e, n]) for a block of one expert's positions; 0 for the
    slots of the group not held here."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert > num_local:  # past the last group
        return
    pos = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    slots = tl.load(slot_ptr + pos)  # [BM]
    valid = slots >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden units
    col_ok = cols < HIDDEN
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert < num_local:
        ks = tl.arange(0, BLOCK_K)
        e = expert.to(tl.int64)
        h_rows = h_ptr + pos.to(tl.int64)[:, None] * INNER  # [BM, 1]
        w_rows = w_ptr + e * (HIDDEN * INNER) + cols[:, None] * INNER  # [BN, 1]
        scale_cols: tl.constexpr = (INNER + 127) // 128
        w_scales = ws_ptr + (e * ((HIDDEN + 127) // 128) + cols // 128) * scale_cols  # [BN]
        for k0 in range(0, INNER, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < INNER
            a = tl.load(_aligned(h_rows, kk[None, :], ALIGNED), mask=valid[:, None] & k_ok[None, :],
                        other=0.0)  # [BM, BK]
            w = tl.load(_aligned(w_rows, kk[None, :], ALIGNED), mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BN, BK]
            if FP8_W:
                w = w.to(tl.float32) * tl.load(w_scales + k0 // 128, mask=col_ok, other=0.0)[:, None]
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
        route_w = tl.load(route_w_ptr + slots, mask=valid, other=0.0).to(tl.float32)  # [BM]
        acc = acc * route_w[:, None]
    out = _aligned(out_ptr, tl.where(valid, slots, 0).to(tl.int64)[:, None] * HIDDEN + cols[None, :], ALIGNED)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _ordered_sum_kernel(slots_ptr, order_ptr, out_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """out[t] = 0 + slots[t, order[t, 0]] + slots[t, order[t, 1]] + ..., rounded to out's dtype after each add
    as the torch sum in that dtype rounds."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ok = cols < HIDDEN
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(order_ptr + row * TOP_K + j)
        value = tl.load(slots_ptr + (row * TOP_K + slot) * HIDDEN + cols, mask=ok, other=0.0)
        acc = (acc + value.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def route_blocks(expert_ids: torch.Tensor, held: range, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups the T·k slots by local expert on the device -> (slot of each position [num_blocks·BM] int32, -1 =
    padding; local expert of each block [num_blocks] int32: E_local = the group not held here, E_local + 1 =
    past the last group). num_blocks is a bound from the shapes alone (no sync)."""
    num_local, device = len(held), expert_ids.device
    local = expert_ids.reshape(-1).long() - held.start  # [N]
    group = torch.where((local >= 0) & (local < num_local), local, num_local)  # [N] in [0, E]
    order = group.argsort(stable=True)  # [N]
    sorted_group = group[order]  # [N]
    first = torch.searchsorted(sorted_group, torch.arange(num_local + 2, device=device))  # [E+2]
    padded = (first[1:] - first[:-1] + block_m - 1) // block_m * block_m  # [E+1]
    ends = padded.cumsum(0)  # [E+1]
    num_slots = group.shape[0]
    pos = (ends - padded)[sorted_group] + torch.arange(num_slots, device=device) - first[sorted_group]  # [N]
    num_blocks = (num_slots + min(num_local + 1, num_slots) * (block_m - 1)) // block_m
    slot_of_pos = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=device)
    slot_of_pos.scatter_(0, pos, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m  # [num_blocks]
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)  # [num_blocks]
    return slot_of_pos, block_expert


def routed_slots(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, held: range, swiglu_limit: float | None = None,
                 fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
                 tiles: dict | None = None) -> torch.Tensor:
    """x [T, hidden], expert_ids (global, -1 = none) and weights [T, k], gate_up [E_local, 2I, hidden], down
    [E_local, hidden, I] -> [T, k, hidden] in x's dtype: slot j = weight_j · expert_j(x), 0 where not held.
    fp8_scales: (gate_up scale_inv [E, ceil(2I/128), ceil(hidden/128)], down's [E, ceil(hidden/128), ceil(I/128)])
    for float8_e4m3fn weights. out: a [T, k, hidden] buffer to write (every slot is written)."""
    num_rows, top_k = expert_ids.shape
    hidden, inner = down.shape[1], down.shape[2]
    if out is None:
        out = torch.empty((num_rows, top_k, hidden), dtype=x.dtype, device=x.device)  # [T, k, hidden]
    if num_rows * top_k == 0:
        return out
    block_m = block_m_for(num_rows * top_k, len(held))
    tiles = tiles or TILES
    up_tiles, down_tiles = tiles[("gate_up", block_m)], tiles[("down", block_m)]
    slot_of_pos, block_expert = route_blocks(expert_ids, held, block_m)
    fp8 = fp8_scales is not None
    if fp8 and (QUANT_BLOCK % up_tiles.block_k or QUANT_BLOCK % down_tiles.block_k):
        raise ValueError(f"FP8 weights need BLOCK_K dividing {QUANT_BLOCK} (one scale per row per step)")
    gate_up_scale, down_scale = fp8_scales if fp8 else (gate_up, down)  # not read without FP8 weights
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    h = torch.empty((slot_of_pos.shape[0], inner), dtype=x.dtype, device=x.device)  # [positions, I]
    aligned = rows_aligned((x, gate_up, down, h, out), (hidden, inner))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 models: no TF32 rounding (torch's default)
    _gate_up_kernel[(num_blocks := block_expert.shape[0], triton.cdiv(inner, up_tiles.block_n))](
        x, gate_up, gate_up_scale.contiguous(), h, slot_of_pos, block_expert, len(held), top_k,
        float(swiglu_limit or 0.0), HIDDEN=hidden, INNER=inner, HAS_LIMIT=swiglu_limit is not None, FP8_W=fp8,
        ALIGNED=aligned, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=up_tiles.block_n, BLOCK_K=up_tiles.block_k,
        num_warps=up_tiles.num_warps, num_stages=up_tiles.num_stages)
    _down_kernel[(num_blocks, triton.cdiv(hidden, down_tiles.block_n))](
        h, down, down_scale.contiguous(), weights.contiguous(), out, slot_of_pos, block_expert, len(held),
        HIDDEN=hidden, INNER=inner, FP8_W=fp8, ALIGNED=aligned, PRECISION=precision, BLOCK_M=block_m,
        BLOCK_N=down_tiles.block_n, BLOCK_K=down_tiles.block_k, num_warps=down_tiles.num_warps,
        num_stages=down_tiles.num_stages)
    return out


def rows_aligned(tensors, row_lengths) -> bool:
    """Whether every tensor starts on 16 bytes and rows of each length are whole 16-byte units (host pointers
    and shapes only: no sync)."""
    return (all(t.data_ptr() % 16 == 0 for t in tensors)
            and all(n * t.element_size() % 16 == 0 for t in tensors for n in row_lengths))


def ordered_sum(slots: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """slots [T, k, hidden] -> [T, hidden] added in expert-id order (-1 first: its slot is 0)."""
    num_rows, top_k, hidden = slots.shape
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=slots.dtype, device=slots.device)  # [T, hidden]
    if num_rows == 0:
        return out
    if top_k == 0:
        return out.zero_()
    order = expert_ids.argsort(dim=1, stable=True).to(torch.int32).contiguous()  # [T, k]
    block_n = min(SUM_BLOCK, pow2(hidden))
    _ordered_sum_kernel[(num_rows, triton.cdiv(hidden, block_n))](
        slots.contiguous(), order, out, TOP_K=top_k, HIDDEN=hidden, BLOCK_N=block_n, num_warps=SUM_WARPS)
    return out


class TritonExperts:
    """`ExpertLoop` on the kernels above; in training (no backward here) the torch reference loop."""

    def sum(self, experts, x, expert_ids, weights) -> torch.Tensor:
        if experts.training:
            return expert_sum(experts, x, expert_ids, weights)
        return ordered_sum(self.slots(experts, x, expert_ids, weights), expert_ids)

    def slots(self, experts, x, expert_ids, weights) -> torch.Tensor:
        if experts.training:
            return expert_slots(experts, x, expert_ids, weights)
        return routed_slots(x, expert_ids, weights, experts.gate_up_proj.detach(), experts.down_proj.detach(),
                            experts.expert_ids, experts.swiglu_limit)

    def add_in_expert_order(self, slots, expert_ids) -> torch.Tensor:
        if slots.requires_grad:
            return sum_in_expert_order(slots, expert_ids)
        return ordered_sum(slots, expert_ids)


def _gemm_config(name: str, kernel, block_m: int, fp8: bool, dtype: str = "bf16") -> dict:
    """The compile record of one GEMM launch at DeepSeek-V3.2's shapes (hidden 7168, I 2048)."""
    t = TILES[(name, block_m)]
    w = "*fp8e4nv" if fp8 else f"*{dtype}"
    common = {"ws_ptr": "*fp32" if fp8 else w, "slot_ptr": "*i32", "block_expert_ptr": "*i32", "num_local": "i32"}
    if name == "gate_up":
        sig = {"x_ptr": f"*{dtype}", "w_ptr": w, "h_ptr": f"*{dtype}", **common, "top_k": "i32", "limit": "fp32"}
        extra = {"HAS_LIMIT": False}
    else:
        sig = {"h_ptr": f"*{dtype}", "w_ptr": w, "route_w_ptr": "*fp32", "out_ptr": f"*{dtype}", **common}
        extra = {}
    cx = {"HIDDEN": 7168, "INNER": 2048, **extra, "FP8_W": fp8, "ALIGNED": True, "PRECISION": "tf32",
          "BLOCK_M": block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k}
    types = {**sig, **{k: "constexpr" for k in cx}}
    sig = {arg: types[arg] for arg in kernel.arg_names}  # in the kernel's argument order
    return {"name": f"{name}_m{block_m}_{'fp8w' if fp8 else dtype}", "kernel": kernel, "signature": sig,
            "constexprs": cx, "num_warps": t.num_warps, "num_stages": t.num_stages, "wgmma": block_m >= 64}


COMPILE_CONFIGS = [
    _gemm_config(name, kernel, block_m, fp8)
    for name, kernel in (("gate_up", _gate_up_kernel), ("down", _down_kernel))
    for block_m in (16, 64) for fp8 in (False, True)
] + [{"name": "ordered_sum_bf16", "kernel": _ordered_sum_kernel,
      "signature": {"slots_ptr": "*bf16", "order_ptr": "*i32", "out_ptr": "*bf16", "TOP_K": "constexpr",
                    "HIDDEN": "constexpr", "BLOCK_N": "constexpr"},
      "constexprs": {"TOP_K": 8, "HIDDEN": 7168, "BLOCK_N": SUM_BLOCK}, "num_warps": SUM_WARPS, "num_stages": 1,
      "wgmma": False}]
